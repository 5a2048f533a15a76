"""How long a block the drafter runs this step (`cost_aware` with `adaptive_block`).

DFlash drafts in one pass over a block of 1 + K query positions per request (the
bonus token and K masks), so its forward costs in proportion to the block whatever
the budgets then keep. Under load the cost-aware budgets keep one or two drafts
per request and most of the block is drafted only to be thrown away. vLLM's DFlash
proposer runs any block length L <= K (`num_speculative_tokens` of `propose`), so
the step can draft only the slots it would verify. A shorter block's drafts are
not exactly the first L of the full block's (the masks attend to each other), but
they are proposals like any other: verification keeps the output lossless.

Choice. Every probe step runs the full block. Its survivals s [B, K] and measured
drafting time give, for each L in 1..K, the best budgets restricted to the first L
slots (`budget.allocate_budgets`) and their expected rate

    rate(L) = tokens_L / (draft_ms(L) + verify_ms(n_L))

where draft_ms(L) is a line in the block's query tokens B (1 + L): through the
measured full block and the measured short blocks when there are some, else
through the context-only time (a step without a draft, from the draft gate) at
L = 0. Steps until the next probe run blocks of L* = argmax rate(L). A probe that
confirms L* doubles the interval to the next (up to `max_interval`); one that
changes it goes back to `min_interval`. The draft gate still compares drafting
(now at L*) with not drafting at all, on measured rates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from adaflash_vllm.proposers.budget import allocate_budgets


@dataclass
class BlockLength:
    full: int  # K
    k_min: int = 1
    min_interval: int = 8
    max_interval: int = 128
    ema: float = 0.3
    length: int = 0  # L* (0: not chosen yet; the first step probes)
    interval: int = 8
    steps_to_probe: int = 0
    probes: int = 0
    probing: bool = False  # this step's block is a probe (full K)
    # EMA of drafting ms per request at each block length L
    ms_per_request: dict[int, float] = field(default_factory=dict)
    last_rates: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.full < 1:
            raise ValueError(f"block length needs K >= 1, got {self.full}")
        self.interval = self.min_interval

    def next_length(self) -> int:
        """The block length of this drafting step (K on a probe)."""
        self.probing = self.length == 0 or self.steps_to_probe <= 0
        if self.probing:
            return self.full
        self.steps_to_probe -= 1
        return self.length

    def observe(
        self,
        *,
        length: int,
        num_reqs: int,
        draft_ms: float,
        survival: torch.Tensor | None,  # [B, L] of this step
        cost: Callable[[float], float] | None,
        context_ms: float = 0.0,
    ) -> None:
        """After a drafting step of block `length`: its drafting time, and on a
        probe (full block) the survivals that choose the next L*."""
        if num_reqs > 0 and draft_ms > 0:
            old = self.ms_per_request.get(length)
            per = draft_ms / num_reqs
            self.ms_per_request[length] = (
                per if old is None else old + self.ema * (per - old)
            )
        probing, self.probing = self.probing, False
        if not probing or length != self.full or survival is None or cost is None:
            return
        best = self.choose(survival, cost, num_reqs, context_ms)
        self.probes += 1
        if best == self.length:
            self.interval = min(2 * self.interval, self.max_interval)
        else:
            self.length, self.interval = best, self.min_interval
        self.steps_to_probe = self.interval

    def draft_ms(self, length: int, num_reqs: int, context_ms: float) -> float:
        """Estimated drafting time of a block of `length` for `num_reqs` requests:
        linear in the block's query tokens (module docstring)."""
        points = sorted(self.ms_per_request.items())
        if len(points) == 1:  # only the full block so far: anchor at context-only
            points = [(0, max(context_ms, 0.0) / max(num_reqs, 1)), *points]
        # Least squares over the measured lengths (through both when there are two).
        xs = [float(lv) for lv, _ in points]
        ys = [m for _, m in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        return max(my + slope * (length - mx), 0.0) * num_reqs

    def choose(
        self,
        survival: torch.Tensor,
        cost: Callable[[float], float],
        num_reqs: int,
        context_ms: float = 0.0,
    ) -> int:
        """argmax over L of rate(L) for the full-block survivals [B, K]."""
        rates = {}
        for length in range(1, self.full + 1):
            extra = self.draft_ms(length, num_reqs, context_ms)
            _, choice = allocate_budgets(
                survival[:, :length], cost, self.k_min, extra_ms=extra
            )
            rates[length] = choice["tokens_per_ms"]
        self.last_rates = rates
        best = max(rates.values())
        # The shortest block within 1% of the best: ties go to less drafting.
        return min(length for length, r in rates.items() if r >= 0.99 * best)

    def to_dict(self) -> dict:
        return {
            "length": self.length or self.full,
            "interval": self.interval,
            "probes": self.probes,
            "ms_per_request": dict(self.ms_per_request),
            "last_rates": dict(self.last_rates),
        }


class ScriptedBlockLength:
    """Block lengths 1, 2, ..., K, 1, 2, ... on successive drafting steps, whatever
    the timings (tests and debugging: every short block length occurs)."""

    def __init__(self, full: int):
        if full < 1:
            raise ValueError(f"block length needs K >= 1, got {full}")
        self.full = full
        self.step = 0
        self.used: dict[int, int] = {}

    def next_length(self) -> int:
        length = 1 + self.step % self.full
        self.step += 1
        self.used[length] = self.used.get(length, 0) + 1
        return length

    def observe(self, **_) -> None:
        pass

    def to_dict(self) -> dict:
        return {"scripted": True, "used": {str(n): c for n, c in self.used.items()}}
