"""Budget policies: how many of the K drafts each request sends to verification.

A policy sees the batch after the drafter's forward and returns k_i per request
(0 <= k_i <= K), or None to keep all K. Fewer verified drafts never change what the
target emits (verification of any prefix of the drafts is lossless); they change how
much verification costs and how much it can accept.

    fixed        all K (stock DFlash)
    debug_ragged k_i = crc32(req_id, round) mod (K + 1), for tests
    paper        k_i = clamp(round(a_hat_i * K * gamma), k_min, K)   (AdaFlash rule)
    cost_aware   the k_i that maximise expected emitted tokens per second of step
                 time, from survival estimates and the measured step-cost curve

Survival s[i, j] = P(draft j of request i is accepted, all before it too) comes from
the length head (a survival head predicts it directly; a ratio head's a_hat gives a
geometric decay with the same expected length) or, for a drafter without a head,
from the drafter's own confidence (cumulative product of the max draft probability,
as vLLM's online estimator starts from). Confidence features are those of the
logits the drafter computed for its drafts (`length_head.draft_confidence`).

Cost-aware choice (vLLM's adaptive verification does the same with its estimator):
sort all (i, j >= k_min) slot survivals descending; for a global budget b,

    tokens(b) = sum_i (1 + sum_{j <= k_min} s_ij) + sum of the top-b survivals
    time(b)   = draft_ms + cost(B * (1 + k_min) + b)
    b*        = argmax tokens(b) / time(b)

where draft_ms is the round's drafting time, already paid: the round is the
unit of throughput, so a slot is worth verifying when it adds tokens faster than
the whole round's rate, not only verification's (leaving draft_ms out trimmed
too much wherever drafting is a large part of a round, e.g. at one request).

and since s is non-increasing in j, the winners form a prefix per request. It runs
at every batch size (no threshold): with a flat cost curve b* = all slots (full K);
with a steep one only the likely slots survive.

Shape symbols: B requests, K drafts per request, H drafter hidden size.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from adaflash_vllm.proposers.cost_model import StepCostModel
from adaflash_vllm.proposers.draft_gate import batch_bucket
from adaflash_vllm.proposers.ratio_ema import RatioEMA

from adaflash_vllm.config import LengthConfig


class BudgetPolicy(Protocol):
    needs_confidence: bool  # choose() reads `confidence`
    needs_history: bool  # choose() reads `history`

    def choose(
        self,
        *,
        req_ids: list[str],
        num_drafts: int,
        hidden_states: torch.Tensor | None,  # [B, K, H] drafter outputs at the masks
        confidence: torch.Tensor | None = None,  # [B, K, 3] draft_confidence
        draft_ms: float = 0.0,  # this round's drafting time so far (already paid)
        history: torch.Tensor | None = None,  # [B, 3] length_head.round_history
    ) -> list[int] | None: ...


class FixedBudget:
    """Every request verifies all K drafts: stock DFlash."""

    needs_confidence = needs_history = False

    def choose(
        self,
        *,
        req_ids,
        num_drafts,
        hidden_states,
        confidence=None,
        draft_ms=0.0,
        history=None,
    ) -> list[int] | None:
        return None


class DebugRaggedBudget:
    """k_i = crc32(req_id, round) mod (K + 1): ragged, deterministic, includes 0."""

    needs_confidence = needs_history = False

    def __init__(self) -> None:
        self._round: dict[str, int] = {}

    def choose(
        self,
        *,
        req_ids,
        num_drafts,
        hidden_states,
        confidence=None,
        draft_ms=0.0,
        history=None,
    ):
        live = set(req_ids)
        self._round = {r: n for r, n in self._round.items() if r in live}
        budgets = []
        for req_id in req_ids:
            n = self._round.get(req_id, 0)
            self._round[req_id] = n + 1
            budgets.append(zlib.crc32(f"{req_id}:{n}".encode()) % (num_drafts + 1))
        return budgets


# ------------------------------------------------------------------ survival


_RHO_GRID = 4097  # table points for the inverse of rho -> sum_j rho^j


@functools.lru_cache(maxsize=16)
def _survival_table(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """rho on an even grid over [0, 1] and the expected length sum_{j<=k} rho^j
    at each (strictly increasing from 0 to k)."""
    rho = torch.linspace(0.0, 1.0, _RHO_GRID, dtype=torch.float64, device=device)
    j = torch.arange(1, k + 1, dtype=torch.float64, device=device)
    total = (rho.unsqueeze(-1) ** j).sum(-1)
    return rho.float(), total.float()


def geometric_survival(a_hat: torch.Tensor, k: int) -> torch.Tensor:
    """s [B, K] with s_j = rho^j and sum_j s_j = a_hat * K: rho from a tabulated
    inverse (a handful of vectorised ops per step; bisection took ~150)."""
    rho, total = _survival_table(k, a_hat.device)
    target = a_hat.float().clamp(0, 1) * k  # [B]
    hi = torch.searchsorted(total, target).clamp(1, _RHO_GRID - 1)
    t0, t1 = total[hi - 1], total[hi]
    w = ((target - t0) / (t1 - t0)).clamp(0, 1)
    r = rho[hi - 1] + w * (rho[hi] - rho[hi - 1])
    j = torch.arange(1, k + 1, dtype=torch.float32, device=a_hat.device)
    return r.unsqueeze(-1) ** j


class HeadSurvival:
    """Survival from the length head: its own curve (survival kind), or geometric
    from its predicted acceptance ratio (ratio kind). A head with history reads
    each request's previous round (`length_head.round_history`; None: none)."""

    def __init__(self, head: torch.nn.Module):
        self.head = head
        self.needs_confidence = bool(getattr(head, "needs_confidence", False))
        self.needs_history = bool(getattr(head, "history", False))

    def fits(self, num_drafts: int) -> bool:
        """A survival head reads exactly the K slots it was trained for; a ratio
        head's pooled inputs take any block."""
        return getattr(self.head, "num_drafts", None) in (None, num_drafts)

    @torch.no_grad()
    def __call__(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.needs_confidence:
            return self.head.survival(hidden, confidence, history)
        return geometric_survival(self.ratio(hidden), hidden.shape[1])

    @torch.no_grad()
    def ratio(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """a_hat [B]: the head's predicted accepted fraction of the K drafts."""
        return self.head.ratio(hidden, confidence, history)


class ConfidenceSurvival:
    """Survival from the drafter's own confidence: cumprod of max draft probability
    (confidence features of the drafts' logits; feature 0 is log p_top1)."""

    needs_confidence = True
    needs_history = False

    def fits(self, num_drafts: int) -> bool:
        return True

    @torch.no_grad()
    def __call__(
        self, hidden: torch.Tensor | None, confidence: torch.Tensor, history=None
    ) -> torch.Tensor:
        return confidence[..., 0].float().exp().cumprod(-1)

    def ratio(
        self, hidden: torch.Tensor | None, confidence: torch.Tensor, history=None
    ) -> torch.Tensor:
        return self(hidden, confidence).mean(-1)


# ------------------------------------------------------------------ policies


class PaperBudget:
    """k_i = clamp(round(a_hat_i * K * gamma), k_min, K)."""

    def __init__(
        self,
        survival: Callable[[torch.Tensor], torch.Tensor],
        *,
        gamma: float,
        k_min: int,
    ):
        self.survival, self.gamma, self.k_min = survival, gamma, k_min
        self.needs_confidence = bool(getattr(survival, "needs_confidence", False))
        self.needs_history = bool(getattr(survival, "needs_history", False))
        self.last_expected: torch.Tensor | None = None  # [B] E[accepted] chosen

    def choose(
        self,
        *,
        req_ids,
        num_drafts,
        hidden_states,
        confidence=None,
        draft_ms=0.0,
        history=None,
    ) -> list[int]:
        a_hat = self.survival.ratio(hidden_states, confidence, history).float()
        k = (a_hat * num_drafts * self.gamma).round().clamp(self.k_min, num_drafts)
        self.last_expected = a_hat * num_drafts
        return k.long().tolist()


class AcceptanceCalibration:
    """Realised vs predicted accepted drafts, as EMAs of both sums; `factor` scales
    survivals so that predictions match what verification really accepts (a head
    trained offline can be far off on served traffic, e.g. past end-of-answer)."""

    def __init__(self, ema: float = 0.1, bounds: tuple[float, float] = (0.05, 2.0)):
        self.bounds = bounds
        self.sums = RatioEMA(ema)  # realised / predicted

    @property
    def factor(self) -> float:
        ratio = self.sums.ratio()
        lo, hi = self.bounds
        return 1.0 if ratio is None else min(hi, max(lo, ratio))

    def observe(self, predicted: float, realised: float) -> None:
        """One drafting step: the expected accepted drafts of the chosen budgets
        (uncalibrated survivals) and the drafts verification accepted."""
        self.sums.add(realised, predicted)

    def to_dict(self) -> dict:
        return {
            "factor": self.factor,
            "predicted": self.sums.den,
            "realised": self.sums.num,
            "observations": self.sums.count,
        }


class _UseState:
    __slots__ = ("every", "gain", "overhead", "waited")

    def __init__(self, every: int) -> None:
        self.gain: float | None = None  # EMA: predicted rate gain of the budgets
        self.overhead = 0.0  # EMA: choosing's own time, as a share of the round
        self.waited = 0  # steps without a choice since the last one
        self.every = every  # steps between checks while choosing does not pay


class BudgetUse:
    """Whether choosing budgets pays at a batch size (per `batch_bucket`).

    Choosing costs time of its own: the drafts' confidence features, the length
    head, the allocation, a device sync. Where verification is cheap (one request
    on this CPU) the budgets it picks save less than that; paired rounds at one
    request measured cost_aware budgets at 0.946 +- 0.048 of verifying all K with
    the same accepted drafts per round (BENCHMARKS.md, run 13). So per bucket this
    keeps EMAs of the allocation's predicted gain (its tokens per ms over full K's,
    minus 1) and of the choice's measured time as a share of the round, and skips
    the choice (all K verified, as `fixed`) while the gain is below that share,
    choosing again after `check_every` steps to follow the batch and the text.
    Each check that finds choosing still not paying doubles that wait, up to
    `max_check_every`; one whose own gain beats the overhead brings it back to
    `check_every`. (At one request on the CPU demo the predicted gain stays near
    0.1-0.5% against an overhead of ~6% of the round: a check every 17 steps is
    ~0.35% of the steps' time; BENCHMARKS.md run 25.)"""

    def __init__(
        self, ema: float = 0.1, check_every: int = 16, max_check_every: int = 256
    ):
        self.ema, self.check_every = ema, check_every
        self.max_check_every = max(max_check_every, check_every)
        self._states: dict[int, _UseState] = {}
        self.chosen_steps = 0
        self.full_k_steps = 0

    def _state(self, num_reqs: int) -> _UseState:
        key = batch_bucket(num_reqs)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = _UseState(self.check_every)
        return st

    def active(self, num_reqs: int) -> bool:
        """Whether this step chooses."""
        st = self._state(num_reqs)
        use = st.gain is None or st.gain > st.overhead or st.waited >= st.every
        st.waited = 0 if use else st.waited + 1
        self.chosen_steps += use
        self.full_k_steps += not use
        return use

    def record(self, num_reqs: int, choice: dict, choose_ms: float) -> None:
        """After a choice: its predicted gain and its own time (ms)."""
        st = self._state(num_reqs)
        full = choice["full_k_tokens_per_ms"]
        gain = choice["tokens_per_ms"] / full - 1.0 if full > 0 else 0.0
        round_ms = choice["verify_ms"] + choice.get("draft_ms", 0.0)
        share = choose_ms / round_ms if round_ms > 0 else 0.0
        if st.gain is None:
            st.gain, st.overhead = gain, share
        else:
            st.gain += self.ema * (gain - st.gain)
            st.overhead += self.ema * (share - st.overhead)
        if gain > st.overhead:
            st.every = self.check_every  # this choice paid: follow closely
        elif st.gain <= st.overhead:
            st.every = min(2 * st.every, self.max_check_every)

    def to_dict(self) -> dict:
        return {
            "chosen_steps": self.chosen_steps,
            "full_k_steps": self.full_k_steps,
            "buckets": {
                str(b): {"gain": st.gain, "overhead": st.overhead, "every": st.every}
                for b, st in sorted(self._states.items())
            },
        }


class CostAwareBudget:
    """Budgets maximising expected emitted tokens per second (module docstring).
    The expected tokens it reports (for the draft gate) are scaled by the online
    `calibration`; allocation uses the raw survivals (a calibration learnt at one
    load would otherwise shorten drafts at another, where verification is cheap)."""

    def __init__(
        self,
        survival: Callable[[torch.Tensor], torch.Tensor],
        cost: Callable[[], StepCostModel | None],
        *,
        k_min: int,
        fallback: PaperBudget,
    ):
        self.survival, self.cost, self.k_min = survival, cost, k_min
        self.needs_confidence = bool(getattr(survival, "needs_confidence", False))
        self.needs_history = bool(getattr(survival, "needs_history", False))
        self.fallback = fallback
        self.last_choice: dict | None = None
        self.last_survival: torch.Tensor | None = None  # [B, K] of the last choice
        self.calibration = AcceptanceCalibration()
        self.use = BudgetUse()
        self.last_predicted: float | None = None  # uncalibrated E[accepted], last step
        # Blocks shorter than a survival head's K (block_length.py) read the
        # drafts' own confidence, which the head's inputs already include.
        self.short_survival = ConfidenceSurvival()

    def choose(
        self,
        *,
        req_ids,
        num_drafts,
        hidden_states,
        confidence=None,
        draft_ms=0.0,
        history=None,
    ) -> list[int]:
        cost = self.cost()
        self.last_predicted = None
        if cost is None:  # no profile (failed or not yet taken): the paper rule
            return self.fallback.choose(
                req_ids=req_ids,
                num_drafts=num_drafts,
                hidden_states=hidden_states,
                confidence=confidence,
                history=history,
            )
        survival = self.survival
        if not getattr(survival, "fits", lambda k: True)(num_drafts):
            survival = self.short_survival
        s = survival(hidden_states, confidence, history).float().cpu()  # [B, K]
        self.last_survival = s
        k_i = self.allocate(s, cost, draft_ms)
        # allocate's expected tokens are B + the chosen slots' survivals.
        self.last_predicted = self.last_choice["expected_tokens"] - len(k_i)
        # What the draft gate compares with plain decoding: calibrated.
        self.last_choice["expected_tokens"] = len(k_i) + self.calibration.factor * (
            self.last_predicted
        )
        return k_i

    def skip_choice(self) -> None:
        """A step that verifies all K without choosing (`BudgetUse`)."""
        self.last_predicted = None

    def observe_accepted(self, accepted: int) -> None:
        """Drafts accepted from the last chosen budgets (same batch, verified)."""
        if self.last_predicted is not None:
            self.calibration.observe(self.last_predicted, accepted)

    def allocate(
        self, s: torch.Tensor, cost: Callable[[float], float], draft_ms: float = 0.0
    ) -> list[int]:
        """k_i for survivals s [B, K] under step-cost curve `cost` (ms vs tokens),
        in a round whose drafting took `draft_ms`."""
        k_i, self.last_choice = allocate_budgets(s, cost, self.k_min, draft_ms)
        return k_i


def allocate_budgets(
    s: torch.Tensor,
    cost: Callable[[float], float],
    k_min: int,
    extra_ms: float = 0.0,
) -> tuple[list[int], dict]:
    """The cost-aware allocation (module docstring) for survivals s [B, K] (CPU)
    under step-cost curve `cost` (ms vs verified tokens), plus `extra_ms` of fixed
    time per step (the round's drafting). Returns (k_i, choice). In numpy: it runs
    on every drafting step, on B * K + 1 candidate budgets, where torch's per-op
    overhead was most of its time (examples/bench_budgets.py)."""
    s = s.detach().to(torch.float64).numpy()
    b, k = s.shape
    k_min = min(k_min, k)
    base_tokens = b + float(s[:, :k_min].sum())
    base_n = b * (1 + k_min)
    free = s[:, k_min:].reshape(-1)
    order = np.argsort(-free, kind="stable")
    gains = np.concatenate([[0.0], np.cumsum(free[order])])
    n = base_n + np.arange(gains.size, dtype=np.float64)
    if hasattr(cost, "many"):  # StepCostModel: one vectorised pass
        times = cost.many(n)
    else:  # any callable (tests, synthetic curves)
        times = np.array([cost(float(x)) for x in n])
    rate = (base_tokens + gains) / (times + extra_ms)
    best = int(np.argmax(rate))
    chosen = np.zeros(b * (k - k_min), dtype=np.int64)
    chosen[order[:best]] = 1
    k_i = chosen.reshape(b, k - k_min).sum(-1) + k_min
    choice = {
        "budget": best,
        "expected_tokens": float(base_tokens + gains[best]),
        "verify_ms": float(times[best]),
        "plain_verify_ms": float(cost(b)),  # the same batch verifying no drafts
        "draft_ms": float(extra_ms),
        "tokens_per_ms": float(rate[best]),
        "full_k_tokens_per_ms": float(rate[-1]),
    }
    return k_i.tolist(), choice


POLICIES = ("fixed", "debug_ragged", "paper", "cost_aware")


def make_budget_policy(
    cfg: LengthConfig,
    *,
    head: torch.nn.Module | None = None,
    cost: Callable[[], StepCostModel | None] = lambda: None,
) -> BudgetPolicy:
    """The policy `cfg.mode` names, with the survival estimate it needs."""
    if cfg.mode == "fixed":
        return FixedBudget()
    if cfg.mode == "debug_ragged":
        return DebugRaggedBudget()
    use_head = cfg.predictor == "head" or (cfg.predictor == "auto" and head is not None)
    if use_head and head is None:
        raise ValueError(
            'adaflash.length.predictor is "head" but the drafter has '
            "no length head (dflash_config.thresh_head_bottleneck_dim)"
        )
    survival = HeadSurvival(head) if use_head else ConfidenceSurvival()
    paper = PaperBudget(survival, gamma=cfg.gamma, k_min=cfg.k_min)
    if cfg.mode == "paper":
        return paper
    return CostAwareBudget(survival, cost, k_min=cfg.k_min, fallback=paper)
