"""EMA admission control for ragged verification batches.

A decode step verifies sum_i (1 + k_i) tokens. With ragged budgets that sum moves
with the length policy, so admitting waiting requests by a fixed `max_num_seqs`
either starves the batch or overfills it. After every step

    N_hat <- (1 - beta) * N_hat + beta * N       (N = requests processed)
    v_hat <- (1 - beta) * v_hat + beta * mean_i (1 + k_i)

and the scheduler admits at most `max(0, floor(budget / v_hat - N_hat))` new requests
(at least one when nothing runs), within vLLM's own limits. Running requests are
never evicted by it; when KV memory runs short vLLM preempts requests back to the
waiting queue (recomputed later), so nothing fails or runs out of memory. The token
budget caps each step's scheduled tokens (vLLM chunks prefills to fit it).
"""

from __future__ import annotations

import math

from adaflash_vllm.config import AdmissionConfig


class AdmissionControl:
    def __init__(self, cfg: AdmissionConfig, num_speculative_tokens: int):
        self.cfg = cfg
        self.n_hat = 0.0
        self.v_hat = 1.0 + num_speculative_tokens  # until rounds are seen: full K
        self._round_tokens = 0
        self._rounds = 0
        self.admitted = 0
        self.max_step_tokens = 0
        self.cap = 0

    def limits(self, running: int, max_active: int, max_tokens: int) -> tuple[int, int]:
        """(max_num_active_reqs, max_num_scheduled_tokens) for this step."""
        budget = min(max_tokens, self.cfg.token_budget or max_tokens)
        self.cap = max(1, math.floor(budget / max(self.v_hat, 1.0)))
        new = max(0, math.floor(self.cap - self.n_hat))
        if running == 0:
            new = max(new, 1)  # an idle engine always makes progress
        return min(max_active, running + new), budget

    def observe_schedule(self, output) -> None:
        self.admitted += len(output.scheduled_new_reqs)
        self.max_step_tokens = max(
            self.max_step_tokens, output.total_num_scheduled_tokens
        )

    def observe_rounds(self, num_drafts: list[int]) -> None:
        self._round_tokens += len(num_drafts) + sum(num_drafts)
        self._rounds += len(num_drafts)

    def observe_rounds_without_drafts(self, n: int) -> None:
        """`observe_rounds` for n rounds of k = 0."""
        self._round_tokens += n
        self._rounds += n

    def end_step(self, requests_processed: int) -> None:
        b = self.cfg.beta
        self.n_hat = (1 - b) * self.n_hat + b * requests_processed
        if self._rounds:
            self.v_hat = (1 - b) * self.v_hat + b * self._round_tokens / self._rounds
        self._round_tokens = self._rounds = 0

    def gauges(self) -> dict[str, float]:
        return {
            "admission_n_hat": self.n_hat,
            "admission_verify_len_ema": self.v_hat,
            "admission_cap": self.cap,
            "admissions_total": self.admitted,
            "max_step_tokens": self.max_step_tokens,
        }
