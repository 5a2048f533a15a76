"""Whether to run the drafter at all this step (`cost_aware` with `skip_drafting`).

Budgets can only trim verification; the drafter's own forward (a block of K + 1
query tokens per request plus K rows of lm_head) is paid before any budget is
chosen. When drafting emits fewer tokens per second than plain decoding would, the
step is better off without a draft: the proposer then only queues the new context
K/V (so the drafter's cache stays in sync) and every request verifies 0 drafts,
which the target serves as a plain decode step.

The gate decides from what steps really deliver, not only from estimates. Each
step's round (from one propose to the next: the drafter's forward, then the target
verifying its drafts) is timed and credited with the tokens it emitted (requests +
accepted drafts), and an EMA of tokens per ms is kept for drafting rounds and for
skipped ones. The gate follows the better mode and explores the other for
`explore_steps` rounds every `interval` rounds; an exploration that confirms the
current mode doubles the interval (up to `max_interval`, `skip_max_interval` while
skipping), one that flips it resets the interval. A switch to drafting that is
undone sooner than skipping would have checked again was noise: skipping resumes
its backoff (without this, under load a lucky exploration of drafting now and then
kept the checks of a losing mode every 8-16 steps). The other way round a quick
return is usually text turning easy again at low load, and drafting's checks of
skipping start over. A decisive result (the winner delivers `decisive_margin`
times the loser's rate) backs off twice as fast:
exploring a mode that clearly loses is a few slow rounds each time, which under
heavy load are most of what the gate costs. While drafting, a drop of `shift_drop`
in drafting's own rate since the last exploration (traffic moved to a domain the
drafter knows less) that leaves it within `decisive_margin` of skipping's last
measured rate starts an exploration at once instead of waiting out the backoff,
unless drafting's long-run rate still beats skipping's by `shift_slow_margin` (at
one request the recent rate dips that far every few rounds: those dips started
half the checks of skipping). While drafting's long-run rate beats skipping's by
`decisive_margin`, checks of skipping back off to `decisive_max_interval` rather
than `max_interval`; a real shift still starts one at once.
With a step-cost curve, a check of skipping while drafting spends no rounds at
all: skipping's rate is predicted from its last measured one (see
`skip_remeasure_steps`), where the prediction decides: a switch, or drafting
ahead by `decisive_margin`. A prediction closer than that is measured (a real
check), and above `predict_max_batch` requests every check is: under load the
curve's level also follows drafting steps, whose output handling the profile
leaves out, so while drafting the prediction reads low and can keep a losing
bucket drafting (one bucket of 16 drafted 1,440 of 1,500 steps in a run, and
one of 60 about 70 s in a served sweep; BENCHMARKS.md run 26). Exploring skips
costs a few slow rounds, so it is only done when the cost model's own estimate
(expected tokens per ms from the budgets and the step-cost curve) does
not already favour drafting by `sure_margin`, nor drafting's measured long-run rate
(below) skipping's last measured one by as much, and a switch to drafting needs that
estimate not to favour skipping by `sure_margin` either; a batch that shrank by a
quarter since the last switch explores drafting at once. A switch needs the other
mode to win by more than `switch_z` standard errors of the two rates (from the
spread of their per-round rates): at low load drafting's rounds emit anywhere from 1
to K + 1 tokens, and without this its EMA dipping below skipping's steady rate by
chance switched the gate off for a third of the steps at one request. A switch to
skipping must also beat drafting's long-run rate (`draft_rate_slow`, an EMA in which
a round of B requests weighs as B one-request rounds would, restarted when the batch
moves by a quarter; ~100 one-request rounds up to `slow_one_request_max_batch`
requests, ~25 beyond): a run of rejected rounds is common in text the drafter serves
well, and skipping such runs at one request still cost 6%. Where that long-run
rate no longer beats skipping's, a drafting run (since the switch to drafting or
the last check of skipping that kept it) that has emitted `run_loss_tokens` per
request fewer tokens than skipping would have in its time starts a check of
skipping at once, and the check leaves drafting whatever the recent rate's noise:
a lucky check of drafting on text the drafter serves badly otherwise started a
run that lasted until the recent rate fell a standard error below skipping's.
While skipping, checks of
drafting back off only to `skip_interval_per_request` steps per request in the
batch: with few requests drafting's rate follows their text, and a stretch of easy
text missed costs several times what a check during a hard one does. From
`check_share_min_batch` requests on they also wait at least until a check's
measured loss is `check_share` of the time skipped in between: at 64 requests a
drafting round loses ~50 ms against skipping, and a backoff doubling from 8
steps checked 7 times (31 drafting steps) in a bucket's first 2,000 steps.
That wait may pass the per-request cap (up to `check_share_max_interval`
steps): the text of 8 or more requests turns easy together only when the
traffic does, and at 8 requests on math checks every 128 steps took 2% of
the time.
Below `check_share_min_batch` requests they are spaced so (up to
`check_share_min_cap` steps) only once checks have lost on net: `check_value`,
what each check's drafting rounds, and the drafting run a switch started, emitted
beyond what skipping would have in their time, falls below zero (an EMA over at
least `check_value_min_checks` checks). On text with easy stretches a check now
and then catches one and pays for many that did not; on a domain the drafter
serves badly none does (on the demo's code prompts spacing them gained 4-6% in
one pair of runs and nothing in a rerun; BENCHMARKS.md run 37).

The engine runs one such gate per batch-size bucket (`BatchSizeGates`): rates in
tokens per ms are only compared between rounds of about the same batch size. What
drafting gains shrinks as the batch grows (verification turns compute-bound), so
once a smaller batch's gate skips decisively, a larger batch's gate is *held*: it
starts skipping when new, explores skipping at once if it was drafting, follows
drafting only while drafting delivers `decisive_margin` times skipping's rate (and,
to switch back to it, by more than the noise), and while skipping it checks
drafting only at its longest backoff. Without this, under load a bucket seen for a
few steps per drain went back to drafting on a lead within the noise (1.36 against
1.14 tokens per ms at 48 requests) while every smaller bucket skipped.

What a bucket learnt holds for the text it learnt it on. When the traffic moves
to another domain while the batch is elsewhere, a bucket visited a few steps at
a time (the tail of a burst, a stream's drain) keeps the old mode: at the end of
the demo's code phase the gates of one to four requests, last run on prose,
drafted code at 0.6x skipping's rate. The gates share one measure of the text
that compares across batch sizes, first-position acceptance (whether a drafted
row's first draft was accepted: every drafted row verifies at least its first,
whatever its budget). A bucket back after an absence, where that has since
fallen to half of what it was at the bucket's last drafting round, restarts
skipping and measures drafting afresh when skipping's backoff at its size comes
due; where it has doubled, it checks drafting at once
(`BatchSizeGates._after_absence`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from adaflash_vllm.proposers.ratio_ema import RatioEMA, running_weight


@dataclass
class DraftGate:
    min_interval: int = 8
    max_interval: int = 128
    # while skipping (at most `skip_interval_per_request` x B as well): under load a
    # check of drafting is 3-4 rounds at 3x a plain step's time
    skip_max_interval: int = 512
    # while drafting's long-run rate beats skipping's by `decisive_margin`: each
    # check of skipping then costs a few rounds at well under drafting's rate (a
    # shift in the traffic still starts one at once: `_draft_rate_fell`)
    decisive_max_interval: int = 512
    explore_steps: int = 3
    sure_margin: float = 2.0  # model says drafting wins by this much: never skip
    decisive_margin: float = 1.25  # a measured win this clear backs off 4x, not 2x
    # skipping's lead at which the engine retires requests from drafting
    # (`length.retire_when_skipping`, proposer.py `_retiring_now`)
    retire_margin: float = 1.25
    shift_drop: float = 0.25  # drafting's rate fell this much since: explore now
    # ... unless drafting's long-run rate is still this times skipping's (at one
    # request the recent rate dips by a quarter every few rounds; inf: any dip)
    shift_slow_margin: float = 1.25
    ema: float = 0.3
    switch_z: float = 1.0  # a switch must beat the rates' noise by this many SEs
    skip_interval_per_request: int = 16  # while skipping, explore at most this x B
    # While skipping at `check_share_min_batch` requests or more, checks of
    # drafting are spaced so that what they lose (each check's drafting rounds
    # against skipping's measured rate) is at most `check_share` of the time
    # spent skipping between them (up to the caps above). Under load a check is
    # 4 rounds at ~3x a plain step's time; doubling from 8 steps, a bucket of
    # 64 requests checked 7 times in 2,000 steps, 4 with this (BENCHMARKS.md
    # run 31).
    # Smaller batches keep checking often: their drafting rate follows a few
    # requests' text, which turns easy again within a few rounds. 0: off.
    check_share: float = 0.01
    check_share_min_batch: int = 8
    # ... and from `check_share_min_batch` requests on, such spacing may wait
    # up to this many steps (at most `skip_max_interval`), past the per-request
    # cap (16 x B: at 8 requests on math a check every 128 steps took 2% of
    # the time, BENCHMARKS.md run 44). 0: the per-request cap.
    check_share_max_interval: int = 512
    # Below `check_share_min_batch` requests, checks spaced by what they lose
    # (once they lose on net: `check_value`) wait up to this many steps (the
    # per-request cap, `skip_interval_per_request` x B, is shorter there).
    check_share_min_cap: int = 128
    # drafting's long-run rate: EMA weight per request in a round (at B requests
    # 1 - (1 - w)^B, at most `ema`; reset when the batch moves by a quarter) ...
    slow_ema_per_request: float = 0.04
    # ... and at one request, where a round's rate is one answer's text: ~100
    # rounds. Over ~25 (0.04) the runs of rejected rounds in prose the drafter
    # serves well switched the gate 7-22 times per 6,000 steps and cost 1.1-2.4%
    # (BENCHMARKS.md run 25); a hard stretch now needs ~100 rounds to switch.
    # At four requests 0.01 per request (25 steps) cost 5% against 0.04.
    slow_ema_one_request: float = 0.01
    # Batches up to this size weigh each request by `slow_ema_one_request`
    # (at two, ~50 rounds). At two requests on prose, where drafting gains
    # ~1.2x, the ~13-round rate of 0.04 per request switched to skipping 15-20
    # times per 3,000 steps, skipped 15-24% of them and retired requests
    # (BENCHMARKS.md run 36).
    slow_one_request_max_batch: int = 2
    drafting: bool = True  # the mode being followed
    interval: int = 8
    step: int = 0
    explore_at: int = 8  # step at which the next exploration starts
    exploring_until: int = 0
    switch_batch: int = 0  # batch size at the last switch / exploration
    switched_at: int = 0  # step of the last switch
    left_interval: int = 0  # interval of the mode the last switch left
    settled_at: int = 0  # step of the last exploration's end
    settled_draft_rate: float | None = None  # drafting's tokens per ms then
    model_ratio: float | None = None  # estimated draft/plain rate, last drafting step
    # tokens per ms of drafting rounds and of skipped ones (EMAs of both sums)
    draft_rate: RatioEMA = field(init=False)
    skip_rate: RatioEMA = field(init=False)
    draft_rate_slow: RatioEMA = field(init=False)  # since the batch was slow_batch
    slow_batch: int = 0
    # EMAs of per-round rates and their squares, per mode (True: drafting): noise
    rate_moments: dict = field(init=False)
    drafted_steps: int = 0
    skipped_steps: int = 0
    # explorations started, by what started them, and switches of mode; checks
    # of skipping on its predicted rate (by cause) and the switches they made
    explorations: dict = field(default_factory=dict)
    switches: int = 0
    predicted_checks: dict = field(default_factory=dict)
    predicted_switches: int = 0
    # steps on which a check of skipping was due while drafting but not worth
    # it: the cost model's estimate ("model") or drafting's long-run rate
    # ("long_run") favoured drafting by `sure_margin`
    passed_checks: dict = field(default_factory=dict)
    context_ms: float = 0.0  # EMA of a skipped step's context-only propose time
    # While drafting, a check of skipping needs no skipped rounds: skipping's
    # rate is predicted from its last measured one, scaled by how the step-cost
    # curve at B tokens (a plain step's cost, `plain_ms` of `should_draft`)
    # moved since. A round without a draft emits one token per request at
    # about a plain step's cost, so the scale follows the machine's speed
    # (drafting's rate follows the text, and is measured). Such a check comes
    # when an exploration would, and decides as `_settle` does; skipping is
    # explored for real only when its last measurement is
    # `skip_remeasure_steps` old (to keep the scale true). That real check comes
    # at the next due exploration even where drafting looks sure (the cost
    # model's estimate or the measured rates by `sure_margin`), which otherwise
    # spares skipping every check: one bad early measurement of skipping, or a
    # miscalibrated head feeding the estimate, would keep drafting for good.
    skip_remeasure_steps: int = 2048
    # Predicted checks only up to this many requests. Under load the curve's
    # level follows drafting steps (each emits several tokens per request whose
    # output handling the profile leaves out), so while drafting skipping's
    # prediction reads low by more than `decisive_margin`: in a served sweep a
    # bucket of 60 kept drafting ~70 s on such checks (BENCHMARKS.md run 26).
    # Larger batches explore skipping for real (a few rounds each check).
    predict_max_batch: int = 4
    plain_ms: float | None = None  # the cost curve at B tokens, this step
    skip_plain_ms: RatioEMA = field(init=False)  # plain_ms over skipped rounds
    skip_measured_at: int = 0  # step of the last skipped round measured
    # A smaller batch's gate skips decisively (set by BatchSizeGates each step):
    # drafting is followed here only on a decisive lead; `held_settled`: the last
    # exploration ended while held
    held: bool = False
    held_settled: bool = False
    # A check of drafting is due but waits (`should_draft(can_check=False)`: the
    # batch holds requests retired from drafting, retired_context.py, whose
    # budget-0 rows would make the round measure neither mode); the proposer
    # lets them draft again (`RetiredContext.unretire`), and the check runs at
    # the next step.
    check_waiting: bool = False
    check_waits: int = 0  # steps a check waited
    # What checks of drafting (while skipping) gained against skipping, in
    # tokens: each check's drafting rounds and, where it switched, the drafting
    # run that followed, every round's tokens less what skipping's rate emits
    # in its time; an EMA over checks (`check_value_ema`), None before the
    # first. Below `check_share_min_batch` requests checks are spaced by what
    # they lose only while this is negative: on text with easy stretches a
    # check now and then catches one and pays for many that did not; on a
    # domain the drafter serves badly none does.
    check_value: float | None = None
    check_value_ema: float = 0.05  # 0: checks below 8 requests never spaced
    check_value_min_checks: int = 16  # ... nor before this many checks ended
    checks_closed: int = 0
    check_value_open: float | None = None  # the check in progress (None: none)
    # A drafting run, since the switch to drafting or the last check of skipping
    # that kept it, that has emitted `run_loss_tokens` per request fewer tokens
    # than skipping's rate would have in its time checks skipping at once, and
    # leaves drafting unless drafting's long-run rate beats skipping's. A lucky
    # check on text the drafter serves badly otherwise starts a run that lasts
    # until drafting's noisy rate falls a standard error below skipping's:
    # ~130-230 steps a switch at two requests on the demo's code
    # prompts (BENCHMARKS.md run 37). 0: off.
    run_loss_tokens: float = 4.0
    run_value: float | None = None  # the run's tokens beyond skipping's
    # `BatchSizeGates`' first-position acceptance after this bucket's last
    # drafting round (and the rows it had counted then), and the engine step
    # (`BatchSizeGates.steps`) of this bucket's last visit: a traffic shift
    # while the batch was elsewhere (`BatchSizeGates._after_absence`)
    accept_stamp: float | None = None
    accept_stamp_rows: int = 0
    seen_at: int = 0

    def __post_init__(self) -> None:
        self.draft_rate, self.skip_rate = RatioEMA(self.ema), RatioEMA(self.ema)
        self.draft_rate_slow = RatioEMA(self.ema)
        self.skip_plain_ms = RatioEMA(self.ema)
        self.rate_moments = {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]}

    def should_draft(
        self, num_reqs: int, plain_ms: float | None = None, can_check: bool = True
    ) -> bool:
        """Called once per step before proposing. `plain_ms`: the step-cost
        curve at `num_reqs` tokens (None: no curve; skipping is then explored).
        `can_check` False: while skipping, a due check of drafting waits (see
        `check_waiting`) instead of starting."""
        self.step += 1
        self.check_waiting = False
        self.plain_ms = plain_ms if plain_ms is not None and plain_ms > 0 else None
        if not 3 * self.slow_batch <= 4 * num_reqs <= 5 * self.slow_batch:
            # The batch moved by more than a quarter: rates are not comparable.
            # A round of B requests weighs as B one-request rounds would.
            per_request = (
                self.slow_ema_one_request
                if num_reqs <= self.slow_one_request_max_batch
                else self.slow_ema_per_request
            )
            w = 1.0 - (1.0 - per_request) ** max(num_reqs, 1)
            self.draft_rate_slow = RatioEMA(min(w, self.ema))
            self.slow_batch = num_reqs
        if self.step < self.exploring_until:
            draft = not self.drafting  # exploring the other mode
        elif self.step == self.exploring_until:
            self._settle()
            draft = self.drafting
        elif (
            not self.drafting
            and not can_check
            and self._check_of_drafting_due(num_reqs)
        ):
            self.check_waiting = True
            self.check_waits += 1
            draft = False
        elif not self.drafting and 4 * num_reqs <= 3 * self.switch_batch:
            self._explore(num_reqs, "batch_shrank")  # drafting may pay again
            draft = True
        elif (reason := self._exploration_due()) and self._worth_exploring():
            if self._can_predict_skipping(num_reqs) and self._check_predicted(
                num_reqs, reason
            ):  # decided on the prediction: no rounds spent
                draft = self.drafting
            else:  # no prediction, or one too close to call: measure
                self._explore(num_reqs, reason)
                draft = not self.drafting
        elif reason and self._skipping_stale():
            # However sure drafting looks (a cost model fed a miscalibrated
            # head, or skipping measured once at a bad moment), a skipping rate
            # that old is measured again for real.
            self._explore(num_reqs, "stale")
            draft = False
        else:
            draft = self.drafting
        self.drafted_steps += draft
        self.skipped_steps += not draft
        return draft

    def _check_of_drafting_due(self, num_reqs: int) -> bool:
        """While skipping: whether this step would start a check of drafting
        (the batch shrank by a quarter, or an exploration is due and worth it)."""
        if 4 * num_reqs <= 3 * self.switch_batch:
            return True
        return bool(self._exploration_due()) and self._worth_exploring()

    def record_round(self, *, drafted: bool, tokens: float, ms: float) -> None:
        """The round of the previous step: whether it drafted, the tokens its
        verification emitted and the ms from its propose to this one."""
        if ms > 0:
            # what a drafting round emitted beyond skipping's rate in its time
            skip = self.skip_rate.ratio()
            gain = tokens - skip * ms if drafted and skip is not None else None
            self._credit_check(drafted, gain)
            if (
                gain is not None
                and skip
                and self.drafting
                and self.run_value is not None
            ):
                self.run_value += gain
            r = tokens / ms
            if drafted:
                self.draft_rate.add(tokens, ms)
                self.draft_rate_slow.add(tokens, ms)
                self._add_rate_moments(True, r, r * r, 1)
            else:
                self._add_skipped_rounds(1, tokens, ms, r, r * r)

    def record_skipped_rounds(
        self, *, rounds: int, tokens: float, ms: float, rate: float, rate_sq: float
    ) -> None:
        """`rounds` skipped rounds at once (steady_skip.py), as that many
        `record_round(drafted=False)` would record them, each weighted alike:
        their mean `tokens` and `ms`, and the mean of their per-round rates
        (tokens per ms) and of its square, for the rate's noise."""
        if rounds <= 0 or ms <= 0:
            return
        self._credit_check(False, None)
        self._add_skipped_rounds(rounds, tokens, ms, rate, rate_sq)

    def _add_skipped_rounds(
        self, n: int, tokens: float, ms: float, rate: float, rate_sq: float
    ) -> None:
        """`n` skipped rounds of mean `tokens` and `ms` (per-round rates of mean
        `rate` and mean square `rate_sq`) into skipping's rate, its noise and
        the plain step cost it was measured at."""
        self.skip_rate.add_many(tokens, ms, n)
        self.skip_measured_at = self.step
        if self.plain_ms is not None:
            self.skip_plain_ms.add_many(self.plain_ms, 1.0, n)
        self._add_rate_moments(False, rate, rate_sq, n)

    def _add_rate_moments(
        self, drafted: bool, rate: float, rate_sq: float, n: int
    ) -> None:
        """`n` rounds of a mode, per-round rates of mean `rate` and mean square
        `rate_sq`, into the EMAs of its rate and squared rate (`rate_noise`)."""
        m = self.rate_moments[drafted]
        a = running_weight(self.ema, m[0] + n, n)
        m[0] += n
        m[1] += a * (rate - m[1])
        m[2] += a * (rate_sq - m[2])

    def _credit_check(self, drafted: bool, gain: float | None) -> None:
        """A round for the check of drafting in progress (`check_value`): a
        drafting round adds its `gain` (its tokens less skipping's in its time;
        None before skipping was measured); a skipped round while following
        skipping ends the check."""
        if self.check_value_open is None:
            return
        if drafted:
            if gain is not None:
                self.check_value_open += gain
        elif not self.drafting:
            value, self.check_value_open = self.check_value_open, None
            self.checks_closed += 1
            if self.check_value is None:
                self.check_value = value
            else:
                self.check_value += self.check_value_ema * (value - self.check_value)

    def rate_noise(self, drafted: bool) -> float:
        """Standard error of a mode's rate EMA: the spread of its per-round rates
        (EMAs of r and r^2) times sqrt(ema / (2 - ema)), an EMA's share of it."""
        n, mean, sq = self.rate_moments[drafted]
        if n < 2:
            return 0.0
        var = max(sq - mean * mean, 0.0)
        return (var * self.ema / (2.0 - self.ema)) ** 0.5

    def _difference_noise(self) -> float:
        """Standard error of the difference between the two modes' rates."""
        return (self.rate_noise(True) ** 2 + self.rate_noise(False) ** 2) ** 0.5

    def record_draft(
        self,
        *,
        num_reqs: int,
        expected_tokens: float,
        verify_ms: float,
        draft_ms: float,
        plain_verify_ms: float,
    ) -> float:
        """After a drafting step: the cost model's estimate of drafting's tokens per
        ms over plain decoding's (used to decide whether skipping is worth a try).
        Returns that ratio."""
        rate_draft = expected_tokens / max(verify_ms + draft_ms, 1e-6)
        rate_plain = num_reqs / max(plain_verify_ms + self.context_ms, 1e-6)
        self.model_ratio = rate_draft / max(rate_plain, 1e-9)
        return self.model_ratio

    def record_skip(self, context_ms: float) -> None:
        """After a skipped step: the context-only propose time it took."""
        a = self.ema if self.context_ms else 1.0
        self.context_ms += a * (context_ms - self.context_ms)

    def charge_skipped(self, ms: float, steps: int) -> None:
        """The skipped steps' context K/V, written later in one pass (`ms` for the
        last `steps` skipped steps): part of what those steps cost. Each step's
        share goes onto skipped rounds' mean time and the context-only time."""
        share = ms / max(steps, 1)
        if self.skip_rate.count:
            self.skip_rate.den += share
        self.context_ms += share

    def skips_decisively(self, margin: float | None = None) -> bool:
        """Following skipping, and its last measured rate beats drafting's, both
        the recent one and the long-run one (`draft_rate_slow`), by `margin`
        (None: `decisive_margin`) and by more than `switch_z` standard errors.
        With one or two requests a round's rate follows its text, and a hard
        stretch there must not hold every larger batch."""
        if self.drafting:  # (every step, for each smaller bucket: cheap first)
            return False
        d, s = self.draft_rate.ratio(), self.skip_rate.ratio()
        if d is None or s is None:
            return False
        d = max(d, self.draft_rate_slow.ratio() or 0.0)
        if s < (self.decisive_margin if margin is None else margin) * d:
            return False
        return s - d > self.switch_z * self._difference_noise()

    def start_held(self, num_reqs: int) -> None:
        """A new gate whose smaller batches skip decisively: skip, and check
        drafting after the longest backoff."""
        self.drafting, self.held, self.held_settled = False, True, True
        self.interval = self._skip_cap(num_reqs)
        self.explore_at = self.step + self.interval

    def _skip_cap(self, num_reqs: int) -> int:
        cap = self.skip_interval_per_request * max(num_reqs, 1)
        return min(self.skip_max_interval, max(self.min_interval, cap))

    def _worth_exploring(self) -> bool:
        if not self.drafting:
            return True
        if self.model_ratio is not None and self.model_ratio >= self.sure_margin:
            self._pass_check("model")
            return False
        # Nor while drafting's long-run rate is `sure_margin` times skipping's last
        # measured one: the per-step estimate above swings with each step's
        # predicted acceptance (at one request from ~1x to 5x), and each check
        # there skipped steps that emit a quarter of a drafting step's tokens.
        if self._drafting_wins_decisively(self.sure_margin):
            self._pass_check("long_run")
            return False
        return True

    def _pass_check(self, why: str) -> None:
        """A due check of skipping not run (`passed_checks`: steps, by why):
        drafting stands confirmed, and its run's count starts again."""
        self.passed_checks[why] = self.passed_checks.get(why, 0) + 1
        self.run_value = 0.0

    def _run_lost(self) -> bool:
        """Drafting, its run has lost `run_loss_tokens` against skipping, and
        drafting's long-run rate does not beat skipping's last measured one
        (where it does, a check would keep drafting: text drafting serves well
        has runs of rejected rounds)."""
        if not (
            self.drafting
            and self.run_loss_tokens > 0
            and self.run_value is not None
            and self.run_value < -self.run_loss_tokens * max(self.switch_batch, 1)
        ):
            return False
        slow, skip = self.draft_rate_slow.ratio(), self.skip_rate.ratio()
        return slow is None or skip is None or slow <= skip

    def _exploration_due(self) -> str | None:
        """Why the other mode is due a check now, if it is."""
        if self.step >= self.explore_at:
            return "backoff"
        if self._run_lost():
            return "run_lost"
        if self._draft_rate_fell():
            return "draft_rate_fell"
        if self.held and self.drafting and not self.held_settled:
            return "held"
        return None

    def _explore(self, num_reqs: int, reason: str) -> None:
        self.explorations[reason] = self.explorations.get(reason, 0) + 1
        if not self.drafting and self.check_value_open is None:
            self.check_value_open = 0.0  # a check of drafting: what it gains
        # +1: the last exploring step's round is only credited at the next step.
        self.exploring_until = self.step + self.explore_steps + 1
        self.switch_batch = num_reqs

    def _settle(self) -> None:
        """End of an exploration: follow whichever mode delivered more."""
        d, s = self.draft_rate.ratio(), self.skip_rate.ratio()
        if d is None or s is None:
            best, grow = self.drafting, 2
        else:
            # Switch only when the other mode wins by more than the rates' noise:
            # at low load a drafting round emits 1 to K + 1 tokens, and an EMA that
            # dips below skipping's steady rate by chance would switch often.
            noise = self.switch_z * self._difference_noise()
            if self.held:
                # Smaller batches skip decisively: drafting gains less here, so it
                # is followed only while it delivers `decisive_margin` times
                # skipping's rate, and a switch back to it must also beat the
                # noise. (Not "margin beyond the noise" while drafting: at 4
                # requests a 1.46x lead was within it, and the bucket flipped.)
                lead = d >= self.decisive_margin * s
                best = lead if self.drafting else lead and d > s + noise
            elif self.drafting:
                # Skipping must also beat drafting's long-run rate: a few rejected
                # rounds in a row are common in text drafting serves well, and at
                # one request skipping them lost 6% (BENCHMARKS.md, the gate at
                # C = 1); steadily rejected drafts (another domain) still switch.
                slow = self.draft_rate_slow.ratio()
                lost = s > d + noise or self._run_lost()
                best = not (lost and (slow is None or s > slow))
            else:
                # Nor a switch to drafting that the cost model's estimate says
                # loses by `sure_margin` (under load a few exploration rounds on
                # easy text, or with fewer prompts in them, measured drafting
                # ahead; at 16 requests the estimate stood at 0.42 of plain).
                model = self.model_ratio
                best = d > s + noise and (
                    model is None or model * self.sure_margin >= 1
                )
            grow = self._growth(d, s)
        self._adopt(best, grow)

    def _growth(self, d: float | None, s: float | None) -> int:
        """How fast the backoff grows: 4x after a decisive result, else 2x."""
        if d is None or s is None:
            return 2
        return 4 if max(d, s) >= self.decisive_margin * min(d, s) else 2

    def _adopt(self, best: bool, grow: int) -> None:
        """Follow mode `best` (True: drafting) and set the next check of the
        other one."""
        cap = self.max_interval if best else self.skip_max_interval
        if best and self._drafting_wins_decisively():
            cap = max(cap, self.decisive_max_interval)
        self.switches += best != self.drafting
        self.run_value = 0.0 if best else None  # a new run, or drafting confirmed
        if best == self.drafting:
            self.interval = min(grow * self.interval, cap)
        elif (
            not best
            and self.left_interval
            and self.step - self.switched_at <= self.left_interval
        ):
            # Back to skipping before its own next check would have come: the
            # switch to drafting was noise, and this confirms skipping, whose
            # backoff resumes instead of starting over.
            self.drafting, self.switched_at = best, self.step
            self.interval = min(grow * self.left_interval, cap)
            self.left_interval = 0
        else:
            self.drafting, self.switched_at = best, self.step
            self.left_interval = self.interval
            self.interval = min(grow // 2 * self.min_interval, cap)
        if not self.drafting:
            # Few requests: drafting's rate follows their text, which turns easy
            # again within a few rounds, and missing that costs far more (3-4x
            # plain's rate at one request) than exploring a hard stretch (-25%).
            cap = self._skip_cap(self.switch_batch)
            # Held: smaller batches check drafting for this one (the longest wait).
            self.interval = cap if self.held else min(self.interval, cap)
            spaced_cap = max(
                cap,
                min(self.check_share_max_interval, self.skip_max_interval)
                if self.switch_batch >= self.check_share_min_batch
                else self.check_share_min_cap,
            )
            self.interval = max(self.interval, min(self._check_spacing(), spaced_cap))
        self.held_settled = self.held
        self.explore_at = self.step + self.interval
        self.settled_at, self.settled_draft_rate = self.step, self.draft_rate.ratio()

    def _check_spacing(self) -> int:
        """While skipping: the fewest steps between checks of drafting for which
        a check's loss is at most `check_share` of the skipping in between (0:
        no such floor: a small batch, no measured loss, or `check_share` 0).
        The loss of a drafting round is its time less the time skipping would
        take for the tokens it emitted (EMAs of both per round)."""
        if self.check_share <= 0:
            return 0
        if self.switch_batch < self.check_share_min_batch and not (
            self.check_value_ema > 0
            and self.checks_closed >= self.check_value_min_checks
            and self.check_value is not None
            and self.check_value < 0
        ):
            return 0
        d, s = self.draft_rate, self.skip_rate
        if not d.count or not s.count or d.num <= 0 or s.num <= 0 or s.den <= 0:
            return 0
        loss_ms = d.den - d.num * s.den / s.num  # per drafting round
        if loss_ms <= 0:
            return 0
        rounds = self.explore_steps + 1  # a check's drafting steps
        return math.ceil(rounds * loss_ms / (self.check_share * s.den))

    def _predicted_skip_rate(self) -> float | None:
        """Skipping's last measured rate, scaled by the plain step's cost then
        over now (None without a curve or a measured skipped round)."""
        skip, then = self.skip_rate.ratio(), self.skip_plain_ms.ratio()
        if skip is None or then is None or self.plain_ms is None:
            return None
        return skip * then / self.plain_ms

    def _can_predict_skipping(self, num_reqs: int) -> bool:
        """Drafting, with a predicted skipping rate measured recently enough,
        at a batch small enough for the prediction (`predict_max_batch`)."""
        return (
            self.drafting
            and num_reqs <= self.predict_max_batch
            and self._predicted_skip_rate() is not None
            and self.step - self.skip_measured_at < self.skip_remeasure_steps
        )

    def _skipping_stale(self) -> bool:
        """Drafting, and skipping's rate was last measured on real skipped
        rounds `skip_remeasure_steps` or more steps ago (or never)."""
        return (
            self.drafting
            and self.step - self.skip_measured_at >= self.skip_remeasure_steps
        )

    def _check_predicted(self, num_reqs: int, reason: str) -> bool:
        """A check of skipping on its predicted rate: `_settle`'s rule, with no
        skipped rounds, where the prediction decides. Returns False (nothing
        adopted) when it is too close to call: skipping is then measured."""
        d, s = self.draft_rate.ratio(), self._predicted_skip_rate()
        best = True
        if d is not None and s is not None:
            if self.held:
                best = d >= self.decisive_margin * s
            else:
                noise = self.switch_z * self._difference_noise()
                slow = self.draft_rate_slow.ratio()
                lost = s > d + noise or self._run_lost()
                best = not (lost and (slow is None or s > slow))
                # Too close to call on the prediction: measure. (Drafting's
                # long-run rate counts: at one request it spans ~100 rounds and
                # the recent one dips near skipping's every few rounds.)
                if best and max(d, slow or 0.0) < self.decisive_margin * s:
                    return False
        self.predicted_checks[reason] = self.predicted_checks.get(reason, 0) + 1
        self.switch_batch = num_reqs
        self.predicted_switches += not best
        self._adopt(best, self._growth(d, s))
        return True

    def _drafting_wins_decisively(self, margin: float | None = None) -> bool:
        """Drafting's long-run rate is `margin` (`decisive_margin`) times
        skipping's last measured one."""
        slow, skip = self.draft_rate_slow.ratio(), self.skip_rate.ratio()
        margin = self.decisive_margin if margin is None else margin
        return slow is not None and skip is not None and slow >= margin * skip

    def _draft_rate_fell(self) -> bool:
        """Drafting, its rate fell by `shift_drop` since the last exploration (e.g.
        traffic moved to a domain the drafter knows less), and it is no longer a
        decisive win over skipping's last measured rate: re-check skipping now
        rather than after a long backoff. (Where drafting wins by far, as at low
        load, its noisy rate never comes near skipping's and this never fires.)"""
        rate, then = self.draft_rate.ratio(), self.settled_draft_rate
        skip = self.skip_rate.ratio()
        return (
            self.drafting
            and rate is not None
            and then is not None
            and skip is not None
            and self.step >= self.settled_at + self.min_interval
            and rate < (1.0 - self.shift_drop) * then
            and rate < self.decisive_margin * skip
            and not self._drafting_wins_decisively(self.shift_slow_margin)
        )

    def forget_drafting(self) -> None:
        """Drop what drafting's rounds measured here (its rates and their noise,
        the cost model's last estimate, the run in progress): they describe
        text the traffic has left (`BatchSizeGates._after_absence`)."""
        self.draft_rate = RatioEMA(self.ema)
        self.draft_rate_slow = RatioEMA(self.draft_rate_slow.ema)
        self.rate_moments[True] = [0, 0.0, 0.0]
        self.settled_draft_rate = self.model_ratio = self.run_value = None

    def restart_skipping(self, num_reqs: int) -> None:
        """Traffic moved to text drafting serves far worse than when this bucket
        last drafted: forget drafting's rates, skip, and check drafting afresh
        when skipping at `num_reqs` requests would (`_skip_cap`: 16 steps per
        request). A check after 8 steps spent a few drafting rounds in every
        short visit (a stream's drain), as many as the old mode had."""
        self.forget_drafting()
        self.switches += self.drafting
        self.drafting, self.switched_at, self.left_interval = False, self.step, 0
        self.exploring_until = 0  # (an exploration in progress ends)
        self.check_value_open = None
        self.switch_batch = num_reqs
        self.interval = self._skip_cap(num_reqs)
        self.explore_at = self.step + self.interval

    def check_drafting_now(self) -> None:
        """Traffic moved to text drafting serves far better than when this
        bucket last drafted: forget drafting's rates and make a check of
        drafting due now (it runs as any due check, waiting for retired
        requests to draft again where there are some)."""
        self.forget_drafting()
        self.explore_at = min(self.explore_at, self.step)

    def to_dict(self) -> dict:
        return {
            "drafting": self.drafting,
            "interval": self.interval,
            "drafted_steps": self.drafted_steps,
            "skipped_steps": self.skipped_steps,
            "draft_tokens_per_ms": self.draft_rate.ratio(),
            "skip_tokens_per_ms": self.skip_rate.ratio(),
            "draft_rate_noise": self.rate_noise(True),
            "skip_rate_noise": self.rate_noise(False),
            "model_ratio": self.model_ratio,
            "context_ms": self.context_ms,
            "held": self.held,
            "check_waits": self.check_waits,
            "check_value": self.check_value,
            "checks_closed": self.checks_closed,
            "explorations": dict(self.explorations),
            "switches": self.switches,
            "predicted_checks": dict(self.predicted_checks),
            "predicted_switches": self.predicted_switches,
            "passed_checks": dict(self.passed_checks),
            "predicted_skip_tokens_per_ms": self._predicted_skip_rate(),
        }


def batch_bucket(num_reqs: int) -> int:
    """The batch-size bucket `num_reqs` falls in: 1 to 8 each their own, then four
    per doubling, named by their largest size ((8, 10], (10, 12], ..., (28, 32],
    (32, 40], ...). Upper-inclusive, so that a batch hovering at or just below a
    round concurrency (31-32 requests at 32) stays in one bucket."""
    if num_reqs <= 8:
        return max(num_reqs, 1)
    step = 1 << ((num_reqs - 1).bit_length() - 3)  # a quarter of the doubling
    return -(-num_reqs // step) * step


@dataclass
class BatchSizeGates:
    """A `DraftGate` per batch-size bucket (`batch_bucket`), each with its own
    rates, mode and backoff; the engine uses the bucket of each step's batch.

    Tokens per ms scale with the batch, so rates of one gate measured at different
    batch sizes do not compare: under served load the batch grows and drains all
    the time (a burst of arrivals, the tail of a burst). One gate compared drafting
    rounds at 31 requests with skipped rounds from a tail at 12 and kept drafting at
    32 requests for long stretches, where stock DFlash delivers 0.6-0.7x of
    plain decoding. Per bucket, what a bucket learnt holds the next time the batch
    is back in it, and a tail needs no re-learning at 32 either. A bucket seen for
    the first time starts in the mode of the bucket before it, or held and skipping
    when a smaller bucket skips decisively (see the module's docstring).
    """

    template: DraftGate = field(default_factory=DraftGate)  # fresh buckets' settings
    per_batch_size: bool = True  # False: one gate for every batch (experiments)
    gates: dict[int, DraftGate] = field(default_factory=dict)
    current: DraftGate | None = None  # the bucket of the last should_draft
    last_skip: DraftGate | None = None  # the bucket of the last skipped step
    switched: bool = False  # the last should_draft switched its bucket's mode
    # First-position acceptance: an EMA over drafted rows (`accept_ema_per_row`
    # per row) of whether the row's first draft was accepted, whatever bucket
    # drafted it (`record_first_acceptance`). Every drafted row verifies at least
    # its first draft, so unlike tokens per round it compares across batch sizes
    # and budgets: it follows the text. A bucket revisited after
    # `shift_absence_steps` engine steps away, where it has since fallen below
    # (1 - `accept_drop`) of what it was at the bucket's last drafting round
    # (over at least `shift_min_rows` new rows), restarts skipping with fresh
    # drafting rates (checking drafting when skipping at its size would);
    # where it has risen as far, the bucket checks drafting at once. A bucket
    # visited a few steps at a time (a burst's tail, a stream's drain)
    # otherwise keeps the mode the old text taught it (BENCHMARKS.md run 41).
    # 0: off.
    accept_drop: float = 0.5
    accept_ema_per_row: float = 1 / 32
    shift_absence_steps: int = 32
    shift_min_rows: int = 32
    first_accept: float | None = None
    first_accept_rows: int = 0  # drafted rows counted so far
    steps: int = 0  # should_draft calls (engine steps with a gate verdict)
    shifts: dict = field(default_factory=dict)  # "fell" / "rose": times acted on

    def should_draft(
        self, num_reqs: int, plain_ms: float | None = None, can_check: bool = True
    ) -> bool:
        self.steps += 1
        bucket = batch_bucket(num_reqs) if self.per_batch_size else 0
        gate = self.gates.get(bucket)
        following = gate.drafting if gate is not None else None
        if gate is not None and self.steps - gate.seen_at > self.shift_absence_steps:
            self._after_absence(gate, num_reqs)
        held = self.per_batch_size and any(
            b < bucket and g.skips_decisively() for b, g in self.gates.items()
        )
        if gate is None:
            gate = self.gates[bucket] = copy.deepcopy(self.template)
            if held:
                gate.start_held(num_reqs)
            elif self.current is not None:
                gate.drafting = self.current.drafting
        gate.seen_at = self.steps
        if gate.held and not held and not gate.drafting:
            # No longer held: the smaller batch went back to drafting; check soon.
            gate.explore_at = min(gate.explore_at, gate.step + gate.min_interval)
        gate.held = held
        self.current = gate
        if following is None:  # a new bucket
            following = gate.drafting
        draft = gate.should_draft(num_reqs, plain_ms, can_check)
        # (a restart after an absence counts: `_after_absence`)
        self.switched = gate.drafting != following
        if not draft:
            self.last_skip = gate
        return draft

    def record_round(self, *, drafted: bool, tokens: float, ms: float) -> None:
        """The previous step's round: the bucket that decided it."""
        if self.current is not None:
            self.current.record_round(drafted=drafted, tokens=tokens, ms=ms)

    def record_first_acceptance(self, rows: int, accepted: int) -> None:
        """The previous step's drafting round: `rows` requests verified at least
        one draft, `accepted` of them their first. Stamps the bucket that
        decided it with the new level."""
        if rows <= 0:
            return
        self.first_accept_rows += rows
        w = running_weight(self.accept_ema_per_row, self.first_accept_rows, rows)
        level = self.first_accept if self.first_accept is not None else 0.0
        self.first_accept = level + w * (accepted / rows - level)
        if self.current is not None:
            self.current.accept_stamp = self.first_accept
            self.current.accept_stamp_rows = self.first_accept_rows

    def _after_absence(self, gate: DraftGate, num_reqs: int) -> None:
        """`gate`'s bucket is back after `shift_absence_steps`: act on a shift of
        first-position acceptance since its last drafting round."""
        then, now = gate.accept_stamp, self.first_accept
        if (
            self.accept_drop <= 0
            or then is None
            or now is None
            or self.first_accept_rows - gate.accept_stamp_rows < self.shift_min_rows
        ):
            return
        keep = 1.0 - self.accept_drop
        if gate.drafting and now < keep * then:
            gate.restart_skipping(num_reqs)
            self.shifts["fell"] = self.shifts.get("fell", 0) + 1
        elif not gate.drafting and then < keep * now:
            gate.check_drafting_now()
            self.shifts["rose"] = self.shifts.get("rose", 0) + 1
        else:
            return
        # acted on: the next visit compares with the level now
        gate.accept_stamp, gate.accept_stamp_rows = now, self.first_accept_rows

    def record_draft(self, **kwargs: float) -> float:
        return self.current.record_draft(**kwargs)

    def record_skip(self, context_ms: float) -> None:
        self.current.record_skip(context_ms)

    def charge_skipped(self, ms: float, steps: int) -> None:
        if self.last_skip is not None:
            self.last_skip.charge_skipped(ms, steps)

    def configure(self, settings: dict[str, float]) -> None:
        """Set `DraftGate` fields on every bucket and on buckets to come, and
        this class's own (`_GATES_SETTINGS`: `per_batch_size` 0 keeps one gate
        for all batches, `accept_drop` 0 turns off acting on acceptance
        shifts)."""
        settings = dict(settings)
        own = {k: settings.pop(k) for k in _GATES_SETTINGS if k in settings}
        unknown = sorted(set(settings) - set(DraftGate.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown draft gate fields {unknown}")
        for name, value in own.items():
            setattr(self, name, type(getattr(self, name))(value))
        for gate in (self.template, *self.gates.values()):
            for name, value in settings.items():
                setattr(gate, name, type(getattr(gate, name))(value))

    def _now(self) -> DraftGate:
        return self.current if self.current is not None else self.template

    @property
    def drafting(self) -> bool:
        return self._now().drafting

    @property
    def interval(self) -> int:
        return self._now().interval

    @property
    def context_ms(self) -> float:
        return self._now().context_ms

    @property
    def draft_rate(self) -> RatioEMA:
        return self._now().draft_rate

    @property
    def skip_rate(self) -> RatioEMA:
        return self._now().skip_rate

    @property
    def drafted_steps(self) -> int:
        return sum(g.drafted_steps for g in self.gates.values())

    @property
    def skipped_steps(self) -> int:
        return sum(g.skipped_steps for g in self.gates.values())

    def to_dict(self) -> dict:
        return {
            **self._now().to_dict(),
            "drafted_steps": self.drafted_steps,
            "skipped_steps": self.skipped_steps,
            "first_accept": self.first_accept,
            "first_accept_rows": self.first_accept_rows,
            "shifts": dict(self.shifts),
            "buckets": {b: g.to_dict() for b, g in sorted(self.gates.items())},
        }


# BatchSizeGates' own settings that `configure` takes besides DraftGate's
_GATES_SETTINGS = (
    "per_batch_size",
    "accept_drop",
    "accept_ema_per_row",
    "shift_absence_steps",
    "shift_min_rows",
)


class ScriptedDraftGate:
    """Drafts on every `draft_every`-th step only, whatever the timings (tests and
    debugging: puts skipped steps at known places). Or follows `pattern`, cycled
    from the next step: "d" drafts, "s" skips ("dds": two steps of three draft)."""

    def __init__(self, draft_every: int = 1, pattern: str | None = None):
        if draft_every < 1:
            raise ValueError(f"draft_every must be >= 1, got {draft_every}")
        if pattern is not None and (not pattern or set(pattern) - set("ds")):
            raise ValueError(f"pattern takes 'd' and 's' only, got {pattern!r}")
        self.draft_every = draft_every
        self.pattern = pattern
        self.step = self.drafted_steps = self.skipped_steps = 0

    def should_draft(
        self, num_reqs: int, plain_ms: float | None = None, can_check: bool = True
    ) -> bool:
        self.step += 1
        if self.pattern is not None:
            draft = self.pattern[(self.step - 1) % len(self.pattern)] == "d"
        else:
            draft = self.step % self.draft_every == 0
        self.drafted_steps += draft
        self.skipped_steps += not draft
        return draft

    def record_draft(self, **_: float) -> float:
        return 1.0

    def record_round(self, **_: float) -> None:
        pass

    def record_first_acceptance(self, rows: int, accepted: int) -> None:
        pass

    def record_skip(self, context_ms: float) -> None:
        pass

    def charge_skipped(self, ms: float, steps: int) -> None:
        pass

    def to_dict(self) -> dict:
        return {
            "draft_every": self.draft_every,
            "pattern": self.pattern,
            "drafted_steps": self.drafted_steps,
            "skipped_steps": self.skipped_steps,
        }
