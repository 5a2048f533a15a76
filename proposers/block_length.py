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
            return b.length
        b.turn += 1
        b.pending = b.other if b.turn % 2 == 0 else b.length
        if b.pending == b.length:
            b.open_star = None  # a pair is two neighbouring rounds
        return b.pending

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
