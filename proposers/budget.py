"""Budget policies: how many of the K drafts each request sends to verification.

A policy sees the batch after the drafter's forward and returns k_i per request
(0 <= k_i <= K), or None to keep all K (no trimming). Fewer verified drafts never
change what the target emits (verification is lossless for any prefix of the
drafts); they only change how much verification costs and how much it can accept.

Shape symbols: B requests in the batch, K drafts per request, H drafter hidden size.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import torch

from adaflash_vllm.config import LengthConfig


class BudgetPolicy(Protocol):
    def choose(
        self,
        *,
        req_ids: list[str],
        num_drafts: int,
        hidden_states: torch.Tensor | None,  # [B, K, H] drafter outputs at the masks
    ) -> list[int] | None: ...


class FixedBudget:
    """Every request verifies all K drafts: stock DFlash."""

    def choose(self, *, req_ids, num_drafts, hidden_states) -> list[int] | None:
        return None


class DebugRaggedBudget:
    """k_i = crc32(req_id, round) mod (K + 1): ragged, deterministic, includes 0.

    For tests and demos of ragged verification; it ignores acceptance entirely.
    """

    def __init__(self) -> None:
        self._round: dict[str, int] = {}

    def choose(self, *, req_ids, num_drafts, hidden_states) -> list[int]:
        live = set(req_ids)
        self._round = {r: n for r, n in self._round.items() if r in live}
        budgets = []
        for req_id in req_ids:
            n = self._round.get(req_id, 0)
            self._round[req_id] = n + 1
            budgets.append(zlib.crc32(f"{req_id}:{n}".encode()) % (num_drafts + 1))
        return budgets


POLICIES = {"fixed": FixedBudget, "debug_ragged": DebugRaggedBudget}


def make_budget_policy(cfg: LengthConfig) -> BudgetPolicy:
    return POLICIES[cfg.mode]()
