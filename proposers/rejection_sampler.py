"""AdaFlashRejectionSampler: vLLM's rejection sampler plus verification counters.

Verification itself is vLLM's (lossless for ragged `num_draft_tokens`: each request
is checked against its own drafts only). A step that verifies no draft at all (the
draft gate skipped drafting, or every budget was 0) does not come here: it samples
with vLLM's plain sampler, as a step of plain decoding does (patches.py W7), and
W7 counts its rounds through `record_bonus_only`. This subclass counts, on the
device and without host syncs, drafted and accepted tokens per draft position and
the distribution of per-request verify lengths `1 + k_i`: an independent,
worker-side record of what the ragged batches really verified (the scheduler
keeps its own).

Shape symbols: B requests in the step, K max drafts per request.
"""

from __future__ import annotations

import torch
from typing_extensions import override
from vllm.v1.sample.rejection_sampler import RejectionSampler


class AdaFlashRejectionSampler(RejectionSampler):
    """Counts per-position drafted/accepted tokens and verify lengths."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Rounds per drafts verified (host: the drafts are host lists) and per
        # tokens emitted, accepted + 1 (device: no host sync per step).
        self._verify_hist: list[int] = [0]
        self._emitted: torch.Tensor | None = None
        # `_emitted` on the host, None when stale (`_emitted_counts`)
        self._host_emitted: list[int] | None = []
        self._last_emitted: torch.Tensor | None = None  # [B] of the last forward
        self.recording = True  # off while profiling with dummy batches

    @override
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        output = super().forward(metadata, draft_probs, logits, sampling_metadata)
        if self.recording:
            self._record(metadata.num_draft_tokens, output.sampled_token_ids)
        return output

    def record_bonus_only(self, num_reqs: int) -> None:
        """A step of `num_reqs` rounds that verified no draft (sampled without
        this sampler): each emitted one token."""
        if self.recording:
            self._verify_hist[0] += num_reqs  # host only: nothing drafted or accepted

    def _record(self, num_draft_tokens: list[int], sampled: torch.Tensor) -> None:
        # sampled: [B, K + 1], -1 after the first rejection (and past k_i + 1).
        k_max = sampled.shape[1] - 1
        if len(self._verify_hist) < k_max + 1:
            self._verify_hist += [0] * (k_max + 1 - len(self._verify_hist))
        for k in num_draft_tokens:  # the drafts are host data: count them there
            self._verify_hist[k] += 1
        emitted = (sampled >= 0).sum(-1)  # [B] accepted + 1, on the device
        if self._emitted is None or self._emitted.numel() < k_max + 2:
            grown = torch.zeros(k_max + 2, dtype=torch.long, device=sampled.device)
            if self._emitted is not None:
                grown[: self._emitted.numel()] += self._emitted
            self._emitted = grown
        self._emitted.index_add_(0, emitted, torch.ones_like(emitted))
        self._host_emitted = None
        self._last_emitted = emitted

    def take_emitted(self) -> torch.Tensor | None:
        """Tokens each request emitted (accepted + 1, [B] on the device, rows in
        the step's batch order) in this step's verification, or None when none
        ran since the last call."""
        emitted, self._last_emitted = self._last_emitted, None
        return emitted

    def stats(self) -> dict[str, list[int]]:
        """Cumulative counts; verify_hist[j] = rounds that verified j drafts,
        drafted[j] / accepted[j] = rounds that drafted / accepted draft j + 1."""
        hist = self._verify_hist
        k = max(len(hist) - 1, 1)
        hist = hist + [0] * (k + 1 - len(hist))
        emitted = self._emitted_counts()
        emitted = emitted + [0] * (k + 2 - len(emitted))
        drafted = [sum(hist[j + 1 :]) for j in range(k)]
        accepted = [sum(emitted[j + 2 :]) for j in range(k)]
        return {"drafted": drafted, "accepted": accepted, "verify_hist": hist}

    def accepted_total(self) -> int:
        """Accepted drafts so far (one host sync after a drafting step, shared
        with `stats`; none after steps without drafts, which accept nothing)."""
        return sum(max(n - 1, 0) * c for n, c in enumerate(self._emitted_counts()))

    def _emitted_counts(self) -> list[int]:
        """Rounds by tokens emitted (index n: n tokens) on the host, copied once
        per verification that changed them."""
        if self._host_emitted is None:
            self._host_emitted = self._emitted.cpu().tolist()
        return self._host_emitted
