"""How long a block the drafter runs this step (`cost_aware` with `adaptive_block`).

DFlash drafts in one pass over a block of 1 + L query positions per request (the
bonus token and L masks), and the target then verifies up to 1 + L tokens per
request. vLLM's DFlash proposer runs any L <= K (`num_speculative_tokens` of
`propose`), so each step can draft a shorter block than the configured K. A
shorter block's drafts are not exactly the first L of the full block's (the masks
attend to each other), but they are proposals like any other: verification keeps
the output lossless.

Whether the last slots of a block pay depends on the machine and the load. At one
request on the CPU demo a round of K = 7 takes ~0.6 ms (7%) longer than one of
K = 5, while the 6th and 7th drafts add about 0.08 accepted tokens per round:
stock DFlash with K = 5 is ~4% faster there than with K = 7 (BENCHMARKS.md run
23). On a GPU at low load the full block is nearly free. So L is chosen per
batch-size bucket (`draft_gate.batch_bucket`) by

    rate(L) = B (1 + S_1 + ... + S_L) / round_ms(L)

- S_j, the share of verified rounds that accepted at least j drafts, from the
  rejection sampler's per-position counts (`PositionSurvival`), over every
  drafting step: every round that verified draft j tells about S_j, so the
  estimate is precise where one round's tokens are not (1 to K + 1 at one
  request);
- round_ms(L), the measured time of a round (from one propose to the next: the
  drafter, then verification) at L. A round's time moves with the machine
  (tens of percent within a minute on this VM) by more than L changes it, so
  lengths are compared in *trials*: L* and one other length L' take turns, step
  by step, on clean rounds (the last step's requests, after a drafting step: no
  prompt's context and no skipped steps' backlog). Each L' round and the L*
  round just before it make a pair, and the trial estimates L' over L* as

      gain = ln((1 + S_1 + ... + S_L') / (1 + S_1 + ... + S_L*)) - mean ln(t' / t*)

  with the standard error of the pairs' mean (outlying pairs clipped). The S_j
  are precise (every verified round adds to them); the round times are the
  noise. After `trial_rounds` pairs, and every `trial_rounds // 2` more, the
  trial adopts L' if gain exceeds `z` standard errors, keeps L* if L' cannot be
  `switch_margin` better (gain + z se below it), and otherwise goes on, up to
  `max_trial_rounds` pairs, after which L* stays. Between L = 4 and 5 at one
  request (1-2% apart) a fixed 16 rounds each was a coin toss that sometimes
  settled on the worse length.

Acceptance runs in stretches: along the demo drafter's served prose chains
(K = 7) a round after one that accepted all 7 drafts accepts at least 6 with
probability 0.82 and all 7 with 0.75, against 0.03 after any round. So after a
round in which every request accepted all its drafts the step drafts the full
block whatever L* is, and such rounds are left out of the S_j (which weigh L*
for the other rounds).

Budgets cap the block. Under load the cost-aware budgets verify a draft or two
for most requests, yet the drafter drafts all K slots for every request: at 16
requests on the CPU demo a drafting round of K = 7 costs ~10 ms more than one of
K = 2 for 8% more tokens (always drafting, engines stepped in turn: K = 7 0.73,
K = 2 0.91 of plain; BENCHMARKS.md run 32), and drafting steps are too rare
there (the draft gate skips most) for trials to move L*. Budgets weigh a slot's
verification only (the drafting is paid when they choose); a slot position j of
the next block also costs its drafting, B slots' worth. So after a step whose
budgets were chosen, the bucket's next steps draft at most `cap` slots: the last
position j whose chosen slots' expected tokens (their count times S_j of
verified rounds, `PositionSurvival`: the survivals the budgets read, from the
drafts' confidence in a block shorter than the length head's, priced the third
slot at 16 requests far above the ~0.03 tokens it brought) are at least the
round's rate (tokens per ms, from the same) times B x (one slot's drafting,
`DraftSlotCost`) + (its chosen slots) x (one verified token's cost, the
step-cost curve's slope), both sides as EMAs over the bucket's chosen steps (at one
request a step is one text's moment). When every position of the block pays, the
cap is one more (so that it can grow; a round in which every request accepted
every draft also runs the full block, as above). The cap holds for every
drafting step of the bucket, also those that verify every draft without choosing
(`BudgetUse`: there the choice's gain over the capped block is small, and
uncapped those steps drafted and verified all of L*). A capped step takes no
turn in a trial.

L* starts at K. A trial that adopts L' is followed at once by the next one;
otherwise trials back off (`min_interval` doubling to `max_interval` drafting
steps). L' takes turns between L* - 1, L* + 1
and K (which also keeps the S_j beyond L* measured). Budgets still trim each
request's drafts within L, and the draft gate still compares drafting (at L*)
with not drafting at all.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from adaflash_vllm.proposers.draft_gate import batch_bucket
from adaflash_vllm.proposers.ratio_ema import running_weight


class PositionSurvival:
    """S_j for j = 1..K: accepted-at-least-j over verified-at-least-j rounds, as
    EMAs of both sums of the rejection sampler's per-position counts (its
    `stats()`: cumulative `drafted[j - 1]`, `accepted[j - 1]`). Each update
    weighs as its rounds would one by one (`per_round`): at one request a step
    is one round and the estimate spans ~100 of them; at 32 requests a step
    moves it by a quarter. Until that many rounds have come it is their plain
    mean."""

    def __init__(self, k: int, per_round: float = 0.01):
        self.k, self.per_round = k, per_round
        self._num = [0.0] * k
        self._den = [0.0] * k
        self._rounds = [0] * k  # rounds weighed so far, per position
        self._last: tuple[list[int], list[int]] | None = None

    def update(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Take the counts since the last update (cumulative counts in)."""
        drafted, accepted = list(drafted[: self.k]), list(accepted[: self.k])
        drafted += [0] * (self.k - len(drafted))
        accepted += [0] * (self.k - len(accepted))
        if self._last is not None:
            for j in range(self.k):
                d = drafted[j] - self._last[0][j]
                if d <= 0:
                    continue
                a = accepted[j] - self._last[1][j]
                # the plain mean of the rounds so far until ~1 / per_round of
                # them (the first round alone must not stand for ~100)
                self._rounds[j] += d
                w = running_weight(self.per_round, self._rounds[j], d)
                # EMAs of per-round sums: a / d per round, d rounds at once
                self._num[j] += w * (a / d - self._num[j])
                self._den[j] += w * (1.0 - self._den[j])
        self._last = (drafted, accepted)

    def skip(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Pass over the counts since the last update (rounds that are not to be
        weighed, e.g. full blocks run after a fully accepted round)."""
        self._last = (list(drafted[: self.k]), list(accepted[: self.k]))
        pad = self.k - len(self._last[0])
        if pad > 0:
            self._last[0].extend([0] * pad)
            self._last[1].extend([0] * (self.k - len(self._last[1])))

    def survival(self) -> list[float] | None:
        """[S_1, ..., S_K], non-increasing; None until every position has been
        verified at least once."""
        out, prev = [], 1.0
        for num, den in zip(self._num, self._den, strict=True):
            if den <= 0:
                return None
            prev = min(prev, num / den)
            out.append(prev)
        return out


class DraftSlotCost:
    """What one more query slot of the drafter's block costs (ms), from drafting
    rounds of several sizes: a least-squares line of drafting time against
    slots (B (L + 1)) over EMAs of the sums. Until the slots seen spread, or if
    the line says more, the whole round's time per slot (every part of a round
    taken as growing with its slots: an upper bound)."""

    def __init__(self, ema: float = 0.1):
        self.ema = ema
        self.count = 0
        self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, slots: int, ms: float) -> float:
        """Take one round (`slots` query slots, drafting `ms`); the cost per slot."""
        if slots <= 0 or ms <= 0:
            return self.per_slot(slots, ms)
        self.count += 1
        w = running_weight(self.ema, self.count)  # the plain mean of the first
        self.x += w * (slots - self.x)
        self.y += w * (ms - self.y)
        self.xx += w * (slots * slots - self.xx)
        self.xy += w * (slots * ms - self.xy)
        return self.per_slot(slots, ms)

    def per_slot(self, slots: int, ms: float) -> float:
        whole = ms / slots if slots > 0 and ms > 0 else 0.0
        var = self.xx - self.x * self.x
        if self.count < 2 or var <= (0.05 * self.x) ** 2:
            return whole
        slope = (self.xy - self.x * self.y) / var
        return min(max(slope, 0.0), whole)


@dataclass
class _Bucket:
    """One batch-size bucket's block length and its trials."""

    length: int  # L*
    other: int | None = None  # L' of the running trial
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (t*, t') ms
    open_star: float | None = None  # an L* round waiting for its L' round
    pending: int | None = None  # the trial turn's length this step drafted
    turn: int = 0  # steps into the trial (L* on odd, L' on even)
    interval: int = 16
    drafting_steps: int = 0
    trial_at: int = 0  # drafting step at which the next trial starts
    trials: int = 0
    switches: int = 0
    extended: int = 0  # full blocks run after a fully accepted round
    undecided: int = 0  # trials that ran out of pairs (L* stayed)
    last_trial: dict | None = None  # L', gain, its standard error, pairs
    cap: int | None = None  # block the last chosen step's budgets pay for
    capped: int = 0  # steps that drafted fewer slots for the cap
    draft_cost: DraftSlotCost = field(default_factory=lambda: DraftSlotCost())
    # per slot position, EMAs over chosen steps: its chosen slots' expected
    # tokens, and what its drafting and their verification cost in tokens at
    # the round's rate; and the steps that saw it
    pay_tokens: np.ndarray = field(default=None)
    pay_cost: np.ndarray = field(default=None)
    pay_steps: np.ndarray = field(default=None)


@dataclass
class BlockLength:
    """The drafter's block length per step, per batch-size bucket (module
    docstring). `next_length(B)` before the drafter runs; `record_round` when
    the next step times the round."""

    full: int  # K
    k_min: int = 1
    min_interval: int = 16
    max_interval: int = 512
    trial_rounds: int = 16  # pairs before a trial first decides
    max_trial_rounds: int = 96  # pairs after which an undecided trial keeps L*
    z: float = 2.0  # standard errors a decision needs
    switch_margin: float = 0.01  # keep L* once L' cannot be 1% better
    # a bucket's first drafting steps run the full block without a trial: the
    # first steps of a batch size run slower (1.2-3x at one request here)
    warmup_steps: int = 16
    capping: bool = True  # False: budgets never cap the block (experiments)
    # the cap's per-position EMAs: weight per request in a step, and at most
    pay_ema_per_request: float = 0.05
    pay_ema_max: float = 0.3
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.full < 1:
            raise ValueError(f"block length needs K >= 1, got {self.full}")
        self.shortest = min(max(self.k_min, 1), self.full)

    def _bucket(self, num_reqs: int) -> _Bucket:
        key = batch_bucket(num_reqs)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(
                length=self.full,
                interval=self.min_interval,
                trial_at=self.warmup_steps,
                pay_tokens=np.zeros(self.full),
                pay_cost=np.zeros(self.full),
                pay_steps=np.zeros(self.full),
            )
        return b

    def next_length(self, num_reqs: int, after_full_accept: bool = False) -> int:
        """The block length of this drafting step. `after_full_accept`: every
        request accepted every draft of the last round; then the full block
        (module docstring), and the step takes no turn in a trial."""
        b = self._bucket(num_reqs)
        b.drafting_steps += 1
        b.pending = None
        if after_full_accept:
            b.extended += 1
            return self.full
        if b.other is None and b.drafting_steps > b.trial_at:
            other = self._next_other(b)
            if other is not None:
                b.other, b.pairs, b.open_star, b.turn = other, [], None, 0
        if b.other is None:
            return self._capped(b, b.length)
        b.turn += 1
        turn = b.other if b.turn % 2 == 0 else b.length
        if turn == b.length:
            b.open_star = None  # a pair is two neighbouring rounds
        length = self._capped(b, turn)
        b.pending = turn if length == turn else None  # capped: not a turn
        return length

    def _capped(self, b: _Bucket, length: int) -> int:
        if not self.capping or b.cap is None or b.cap >= length:
            return length
        b.capped += 1
        return b.cap

    def record_budgets(
        self,
        num_reqs: int,
        budgets: Sequence[int],
        survival: Sequence[Sequence[float]],
        *,
        length: int,
        round_ms: float,
        verify_ms_per_token: float,
        draft_ms: float,
        measured: Sequence[float] | None = None,
    ) -> None:
        """A chosen drafting step of block `length`: each request's budget and
        survivals (s[i][j - 1], j <= length), the round's expected time (its
        drafting and the verification of the budgets), what one more verified
        token costs and the drafting's time. `measured`: S_j of verified rounds
        (`PositionSurvival`), which then price each position in place of the
        survivals (predicted ones can be far off deep in a block: run 32).
        Sets the bucket's cap for its next drafting steps (module docstring)."""
        b = self._bucket(num_reqs)
        slot_ms = b.draft_cost.observe(num_reqs * (length + 1), draft_ms)
        s = np.asarray(survival, dtype=np.float64)[:, :length]  # [B, L]
        k = np.asarray(budgets, dtype=np.int64)[:, None]
        chosen = np.arange(1, s.shape[1] + 1)[None, :] <= k  # slot (i, j) verified
        if measured is not None and len(measured) >= s.shape[1]:
            tokens = chosen.sum(0) * np.asarray(measured[: s.shape[1]], np.float64)
        else:
            tokens = (s * chosen).sum(0)  # [L] expected tokens of each position
        rate = (num_reqs + tokens.sum()) / round_ms if round_ms > 0 else 0.0
        ms = num_reqs * slot_ms + chosen.sum(0) * verify_ms_per_token
        n = tokens.size
        # EMAs per position over chosen steps (a step of B requests weighs as B
        # one-request steps would, up to `pay_ema_max`): at one request a step's
        # survivals are one text's moment
        w = min(self.pay_ema_max, 1.0 - (1.0 - self.pay_ema_per_request) ** num_reqs)
        b.pay_steps[:n] += 1
        w = np.maximum(w, 1.0 / b.pay_steps[:n])  # the plain mean of the first
        b.pay_tokens[:n] += w * (tokens - b.pay_tokens[:n])
        b.pay_cost[:n] += w * (rate * ms - b.pay_cost[:n])
        pays = np.flatnonzero(
            (b.pay_tokens[:n] > 0) & (b.pay_tokens[:n] >= b.pay_cost[:n])
        )
        need = int(pays[-1]) + 1 if pays.size else 0  # the last position that pays
        # a block whose every position pays may be short of what pays: one more
        cap = need + 1 if need == length else need
        b.cap = max(self.shortest, min(self.full, cap))

    def _next_other(self, b: _Bucket) -> int | None:
        """L' of the next trial, in turn: L* - 1, L* + 1, K (those that exist)."""
        turn = [n for n in (b.length - 1, b.length + 1) if n != self.full]
        turn.append(self.full)
        turn = [n for n in turn if self.shortest <= n <= self.full and n != b.length]
        return turn[b.trials % len(turn)] if turn else None

    def record_round(
        self,
        *,
        length: int,
        num_reqs: int,
        round_ms: float,
        survival: Sequence[float] | Callable[[], Sequence[float] | None] | None,
    ) -> None:
        """A clean drafting round of block `length` for `num_reqs` requests took
        `round_ms` (its propose to the next); `survival` is
        `PositionSurvival.survival()`, or that method, called only when a trial
        decides (every few pairs: not on every drafting step)."""
        b = self.buckets.get(batch_bucket(num_reqs))
        if b is None or b.other is None or round_ms <= 0 or b.pending != length:
            return  # not a trial's turn (a full block after a full accept, ...)
        b.pending = None
        if length == b.length:
            b.open_star = round_ms
            return
        if b.open_star is None:  # its L* round was not clean
            return
        b.pairs.append((b.open_star, round_ms))
        b.open_star = None
        n = len(b.pairs)
        if n < self.trial_rounds or (n - self.trial_rounds) % max(
            self.trial_rounds // 2, 1
        ):
            return
        if callable(survival):
            survival = survival()
        if survival is None:  # nothing to weigh the lengths by yet: try later
            b.other = None
            b.trial_at = b.drafting_steps + b.interval
            return
        gain, se = paired_gain(b.pairs, survival, b.length, b.other)
        if gain > self.z * se:
            adopt = True
        elif gain + self.z * se < math.log1p(self.switch_margin):
            adopt = False
        elif n >= self.max_trial_rounds:
            adopt = False
            b.undecided += 1
        else:
            return  # undecided: more pairs
        other, b.other = b.other, None
        b.last_trial = {"other": other, "gain": gain, "se": se, "pairs": n}
        b.trials += 1
        if adopt:
            b.length, b.switches = other, b.switches + 1
            b.interval = self.min_interval
            b.trial_at = b.drafting_steps  # go on at once (the next neighbour)
        else:
            b.trial_at = b.drafting_steps + b.interval
            b.interval = min(2 * b.interval, self.max_interval)

    def to_dict(self) -> dict:
        return {
            "full": self.full,
            "buckets": {
                str(key): {
                    "length": b.length,
                    "trial_with": b.other,
                    "interval": b.interval,
                    "drafting_steps": b.drafting_steps,
                    "trials": b.trials,
                    "switches": b.switches,
                    "extended": b.extended,
                    "undecided": b.undecided,
                    "last_trial": b.last_trial,
                    "cap": b.cap,
                    "capped": b.capped,
                }
                for key, b in sorted(self.buckets.items())
            },
        }


def paired_gain(
    pairs: Sequence[tuple[float, float]],
    survival: Sequence[float],
    length: int,
    other: int,
) -> tuple[float, float]:
    """ln(rate(other) / rate(length)) from paired round times (t*, t') and the
    S_j, and the standard error of its time part. Pairs whose log time ratio
    lies beyond 4 robust deviations of the median are clipped there (a pause of
    the machine in one round of a pair is not the length's doing)."""
    d = [math.log(t / s) for s, t in pairs]
    med = statistics.median(d)
    spread = 4 * 1.4826 * statistics.median(abs(x - med) for x in d)
    if spread > 0:
        d = [min(max(x, med - spread), med + spread) for x in d]
    tokens = math.log((1 + sum(survival[:other])) / (1 + sum(survival[:length])))
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
    return tokens - statistics.fmean(d), se


class ScriptedBlockLength:
    """Block lengths 1, 2, ..., K, 1, 2, ... on successive drafting steps, whatever
    the timings (tests and debugging: every short block length occurs)."""

    def __init__(self, full: int):
        if full < 1:
            raise ValueError(f"block length needs K >= 1, got {full}")
        self.full = full
        self.step = 0
        self.used: dict[int, int] = {}

    def next_length(self, num_reqs: int = 1, after_full_accept: bool = False) -> int:
        length = 1 + self.step % self.full  # every length, whatever came before
        self.step += 1
        self.used[length] = self.used.get(length, 0) + 1
        return length

    def record_round(self, **_) -> None:
        pass

    def to_dict(self) -> dict:
        return {"scripted": True, "used": {str(n): c for n, c in self.used.items()}}
