"""AdaFlashRejectionSampler: vLLM's rejection sampler plus verification counters.

Verification itself is vLLM's (lossless for ragged `num_draft_tokens`: each request
is checked against its own drafts only). A step that verifies no draft at all (the
draft gate skipped drafting, or every budget was 0) does not come here: it samples
with vLLM's plain sampler, as a step of plain decoding does (patches.py W7), and
W7 counts its rounds through `record_bonus_only`. This subclass counts drafted
and accepted tokens per draft position and the distribution of per-request verify
lengths `1 + k_i` (on an accelerator on the device, without host syncs; on a CPU,
where the device is the host, in lists: a tensor op per step costs more there
than the Python of a batch's counts): an independent,
worker-side record of what the ragged batches really verified (the scheduler
keeps its own).

Shape symbols: B requests in the step, K max drafts per request.
"""

from __future__ import annotations

import itertools

import torch
from typing_extensions import override
from vllm.v1.sample.rejection_sampler import RejectionSampler


class AdaFlashRejectionSampler(RejectionSampler):
    """Counts per-position drafted/accepted tokens and verify lengths."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Rounds per drafts verified (host: the drafts are host lists) and per
        # tokens emitted, accepted + 1: on an accelerator a device tensor (no
        # host sync per step), on a CPU, where the device is the host, a list.
        self._verify_hist: list[int] = [0]
        self._emitted: torch.Tensor | None = None
        # the counts per tokens emitted on the host (`_emitted_counts`) and the
        # accepted drafts they add up to; None when stale (device counts moved)
        self._host_emitted: list[int] | None = []
        self._host_accepted: int | None = 0
        # [B] of the last forward (a host list where counted on the host)
        self._last_emitted: torch.Tensor | list[int] | None = None
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
        # sampled: [B, K + 1], -1 (vLLM's PLACEHOLDER_TOKEN_ID) after the first
        # rejection (and past k_i + 1).
        k_max = sampled.shape[1] - 1
        if len(self._verify_hist) < k_max + 1:
            self._verify_hist += [0] * (k_max + 1 - len(self._verify_hist))
        for k in num_draft_tokens:  # the drafts are host data: count them there
            self._verify_hist[k] += 1
        if sampled.device.type == "cpu" and self._emitted is None:
            # The device is the host: count in lists. In the engine a step's
            # tensor op costs ~15 us here, more than a batch of 64's rows.
            values = [len(row) - row.count(-1) for row in sampled.tolist()]
            self._last_emitted = values  # a tensor only if the head asks
            counts = self._host_emitted
            if len(counts) < k_max + 2:
                counts += [0] * (k_max + 2 - len(counts))
            for n in values:
                counts[n] += 1
            self._host_accepted += sum(values) - len(values)
            return
        emitted = (sampled >= 0).sum(-1)  # [B] accepted + 1, on the device
        self._last_emitted = emitted
        if self._emitted is None or self._emitted.numel() < k_max + 2:
            grown = torch.zeros(k_max + 2, dtype=torch.long, device=sampled.device)
            if self._emitted is not None:
                grown[: self._emitted.numel()] += self._emitted
            self._emitted = grown
        self._emitted.index_add_(0, emitted, torch.ones_like(emitted))
        self._host_emitted = self._host_accepted = None

    def take_emitted(self) -> torch.Tensor | None:
        """Tokens each request emitted (accepted + 1, [B] on the device, rows in
        the step's batch order) in this step's verification, or None when none
        ran since the last call."""
        emitted, self._last_emitted = self._last_emitted, None
        if isinstance(emitted, list):  # counted on the host (a CPU)
            return torch.tensor(emitted, dtype=torch.long)
        return emitted

    def stats(self) -> dict[str, list[int]]:
        """Cumulative counts; verify_hist[j] = rounds that verified j drafts,
        drafted[j] / accepted[j] = rounds that drafted / accepted draft j + 1."""
        hist = self._verify_hist
        k = max(len(hist) - 1, 1)
        hist = hist + [0] * (k + 1 - len(hist))
        emitted = self._emitted_counts()
        emitted = emitted + [0] * (k + 2 - len(emitted))
        # suffix sums: drafted[j] = sum(hist[j + 1 :]),
        # accepted[j] = sum(emitted[j + 2 :])
        drafted = list(itertools.accumulate(reversed(hist[1:])))[::-1]
        # (the histograms grow together: emitted has exactly k + 2 entries)
        accepted = list(itertools.accumulate(reversed(emitted[2:])))[::-1]
        return {"drafted": drafted, "accepted": accepted, "verify_hist": hist}

    def accepted_total(self) -> int:
        """Accepted drafts so far (on an accelerator one host sync after a
        drafting step, shared with `stats`; none after steps without drafts,
        which accept nothing)."""
        self._emitted_counts()
        return self._host_accepted

    def _emitted_counts(self) -> list[int]:
        """Rounds by tokens emitted (index n: n tokens) on the host, copied once
        per verification that changed them (an accelerator's counts)."""
        if self._host_emitted is None:
            self._host_emitted = self._emitted.cpu().tolist()
            self._host_accepted = sum(
                (n - 1) * c for n, c in enumerate(self._host_emitted) if n > 0
            )
        return self._host_emitted
