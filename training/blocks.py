"""Draft blocks over served (or regenerated) sequences: batching, anchors, logits,
labels and greedy acceptance.

A block anchored at position a holds the known token x[a] and K masks; draft slot k
(1..K) predicts x[a+k]. Its teacher is the target's distribution at a+k given the
true prefix, i.e. the target's logits at position a+k-1 of one forward over the
whole sequence. Anchors live in the response: the first one vLLM drafts from is
the first generated token, at position prompt_len.

Shape symbols: B sequences, N padded length, M anchors per sequence, K drafts per
block, H hidden, T*H concatenated target features, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from adaflash_vllm.training.data import Sequence


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, N] right-padded with 0
    valid: torch.Tensor  # [B, N] bool
    anchors: torch.Tensor  # [B, M]
    anchor_valid: torch.Tensor  # [B, M] bool (padding anchors are False)
    prompt_lens: torch.Tensor  # [B]


def anchor_range(seq: Sequence) -> range:
    """Positions that can anchor a block with at least one label after them."""
    return range(seq.prompt_len, len(seq.token_ids) - 1)


def make_batch(
    seqs: list[Sequence],
    *,
    num_anchors: int | None,
    generator: torch.Generator | None = None,
    forced_anchors: list[list[int]] | None = None,
) -> Batch:
    """Pad `seqs` and pick anchors: all forced ones (e.g. logged round positions),
    then random distinct ones up to `num_anchors` (None = every position)."""
    b = len(seqs)
    n = max(len(s.token_ids) for s in seqs)
    input_ids = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    chosen: list[list[int]] = []
    for i, s in enumerate(seqs):
        input_ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids)
        valid[i, : len(s.token_ids)] = True
        pool = list(anchor_range(s))
        forced = [a for a in (forced_anchors[i] if forced_anchors else []) if a in pool]
        picked = list(dict.fromkeys(forced))
        if num_anchors is None:
            picked = pool
        else:
            rest = [a for a in pool if a not in set(picked)]
            extra = max(0, num_anchors - len(picked))
            if extra and rest:
                order = torch.randperm(len(rest), generator=generator)[:extra]
                picked += [rest[j] for j in order.tolist()]
            picked = picked[: max(num_anchors, len(forced))]
        chosen.append(sorted(picked))
    m = max(1, max(len(c) for c in chosen))
    anchors = torch.zeros(b, m, dtype=torch.long)
    anchor_valid = torch.zeros(b, m, dtype=torch.bool)
    for i, c in enumerate(chosen):
        anchors[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        anchor_valid[i, : len(c)] = True
    prompt_lens = torch.tensor([s.prompt_len for s in seqs])
    return Batch(input_ids, valid, anchors, anchor_valid, prompt_lens)


def block_labels(
    batch: Batch, num_drafts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels [B, M, K], label_valid [B, M, K], teacher_index [B, M, K]).

    teacher_index is the sequence position whose target logits are the teacher for
    each slot (a + k - 1); label_valid is False past the sequence end and for
    padding anchors.
    """
    k = torch.arange(1, num_drafts + 1, device=batch.anchors.device)
    target_pos = batch.anchors.unsqueeze(-1) + k  # [B, M, K]
    n = batch.input_ids.shape[1]
    inside = target_pos < n
    safe = target_pos.clamp(max=n - 1)
    labels = torch.gather(batch.input_ids, 1, safe.flatten(1)).view_as(safe)
    in_seq = torch.gather(batch.valid, 1, safe.flatten(1)).view_as(safe)
    label_valid = inside & in_seq & batch.anchor_valid.unsqueeze(-1)
    return labels, label_valid, safe - 1


def student_logits(
    drafter, target, batch: Batch, features: torch.Tensor, num_drafts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [B, M, K, V] at the K mask slots, and hidden [B, M, K, H]."""
    module = getattr(drafter, "module", drafter)  # DDP wraps the drafter
    ids, positions = module.make_blocks(batch.input_ids, batch.anchors, num_drafts)
    hidden = drafter(
        features=features,
        block_ids=ids,
        block_positions=positions,
        anchors=batch.anchors,
        embed_tokens=target.embed_tokens(),
        context_valid=batch.valid,
    )[:, :, 1:]
    return target.lm_head()(hidden), hidden


def gather_teacher(
    target_logits: torch.Tensor, teacher_index: torch.Tensor
) -> torch.Tensor:
    """Teacher logits [B, M, K, V] from the target's sequence logits [B, N, V]."""
    b, m, k = teacher_index.shape
    idx = teacher_index.reshape(b, m * k, 1).expand(-1, -1, target_logits.shape[-1])
    return torch.gather(target_logits, 1, idx).view(b, m, k, -1)


def accepted_lengths(
    draft_ids: torch.Tensor, labels: torch.Tensor, label_valid: torch.Tensor
) -> torch.Tensor:
    """Greedy verification: leading matches of drafts with labels, [B, M]."""
    match = (draft_ids == labels) & label_valid
    return match.long().cumprod(dim=-1).sum(-1)


def greedy_tau(accept_by_anchor: dict[int, int], seq: Sequence) -> tuple[int, int]:
    """Walk the rounds greedy verification makes along `seq`.

    Starting at the first generated token, each round accepts `accept_by_anchor[a]`
    drafts plus the bonus token. Returns (rounds, tokens emitted), tau = tokens /
    rounds (mean accepted length including the bonus).
    """
    a, end = seq.prompt_len, len(seq.token_ids) - 1
    rounds = emitted = 0
    while a < end:
        step = accept_by_anchor.get(a, 0) + 1
        step = min(step, end - a)
        rounds += 1
        emitted += step
        a += step
    return rounds, emitted
