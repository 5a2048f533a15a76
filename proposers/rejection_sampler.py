"""AdaFlashRejectionSampler: vLLM's rejection sampler plus verification counters.

Verification itself is vLLM's (lossless for ragged `num_draft_tokens`: each request
is checked against its own drafts only). A step that verifies no draft at all (the
draft gate skipped drafting, or every budget was 0) has nothing to reject: it only
samples the bonus token, exactly as vLLM's rejection sampler would, without the
rest of its machinery (the step then costs what a plain decode step's sampling
costs). This subclass counts, on the device and without host syncs, drafted and
accepted tokens per draft position and the distribution of per-request verify
lengths `1 + k_i`: an independent, worker-side record of what the ragged batches
really verified (the scheduler keeps its own).

Shape symbols: B requests in the step, K max drafts per request.
"""

from __future__ import annotations

import torch
from typing_extensions import override
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler


def _only_bonus_tokens(metadata, sampling_metadata) -> bool:
    """No request verifies a draft and no logprobs are asked for (those keep
    vLLM's full path, which assembles them)."""
    return (
        metadata.max_spec_len == 0
        and sampling_metadata.max_num_logprobs is None
        and not sampling_metadata.logprob_token_ids
    )


class AdaFlashRejectionSampler(RejectionSampler):
    """Counts per-position drafted/accepted tokens and verify lengths."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._counts: dict[str, torch.Tensor] | None = None
        self.recording = True  # off while profiling with dummy batches

    @override
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if _only_bonus_tokens(metadata, sampling_metadata):
            output = self._sample_bonus_only(metadata, logits, sampling_metadata)
            if self.recording:  # nothing drafted or accepted: B rounds of 1 token
                self._record_bonus_only(len(metadata.num_draft_tokens), output)
            return output
        output = super().forward(metadata, draft_probs, logits, sampling_metadata)
        if self.recording:
            self._record(metadata.num_draft_tokens, output.sampled_token_ids)
        return output

    def _sample_bonus_only(self, metadata, logits, sampling_metadata) -> SamplerOutput:
        """k_i = 0 for every request: what `RejectionSampler.forward` returns then
        (its bonus sample, [B, 1]), minus the empty rejection pass."""
        bonus = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=sampling_metadata,
            predict_bonus_token=True,
        )
        return SamplerOutput(
            sampled_token_ids=bonus.sampled_token_ids.view(-1, 1), logprobs_tensors=None
        )

    def _record_bonus_only(self, num_reqs: int, output: SamplerOutput) -> None:
        if self._counts is None:  # the first drafting step grows it to K
            self._grow(1, output.sampled_token_ids.device)
        self._counts["verify_hist"][0] += num_reqs

    def _record(self, num_draft_tokens: list[int], sampled: torch.Tensor) -> None:
        # sampled: [B, K + 1], -1 after the first rejection (and past k_i + 1).
        device = sampled.device
        k_max = sampled.shape[1] - 1
        if self._counts is None or self._counts["drafted"].numel() < k_max:
            self._grow(k_max, device)
        drafts = torch.tensor(num_draft_tokens, device=device)
        accepted = (sampled >= 0).sum(-1) - 1
        pos = torch.arange(k_max, device=device)
        c = self._counts
        c["drafted"][:k_max] += (pos < drafts.unsqueeze(-1)).sum(0)
        c["accepted"][:k_max] += (pos < accepted.unsqueeze(-1)).sum(0)
        c["verify_hist"].index_add_(
            0, drafts.clamp(max=c["verify_hist"].numel() - 1), torch.ones_like(drafts)
        )

    def _grow(self, k_max: int, device: torch.device) -> None:
        old = self._counts
        new = {
            "drafted": torch.zeros(k_max, dtype=torch.long, device=device),
            "accepted": torch.zeros(k_max, dtype=torch.long, device=device),
            "verify_hist": torch.zeros(k_max + 1, dtype=torch.long, device=device),
        }
        if old is not None:
            for key, value in old.items():
                new[key][: value.numel()] += value
        self._counts = new

    def stats(self) -> dict[str, list[int]]:
        """Cumulative counts; verify_hist[j] = rounds that verified j drafts."""
        if self._counts is None:
            return {"drafted": [], "accepted": [], "verify_hist": []}
        return {k: v.cpu().tolist() for k, v in self._counts.items()}

    def accepted_total(self) -> int:
        """Accepted drafts so far (one host sync)."""
        return 0 if self._counts is None else int(self._counts["accepted"].sum())
