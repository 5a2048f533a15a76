"""Training and evaluating the length head (proposers/length_head.py).

Labels come from the recomputed target along the sequence for the whole block of
K: the number of leading drafts that greedy verification accepts, over the block's
valid slots. They are not limited to the prefix the head itself let through when
serving, so the head's own truncation does not bias them. The head trains with MSE
on detached drafter hidden states, so it never changes the drafter.

Shape symbols: B sequences, M anchors, K drafts per block, H hidden.
"""

from __future__ import annotations

import torch
from adaflash_vllm.proposers.length_head import (
    LengthHead,
    acceptance_labels,
    calibration,
)
from adaflash_vllm.training.blocks import (
    accepted_lengths,
    block_labels,
    make_batch,
    student_logits,
)
from adaflash_vllm.training.data import Sequence


def head_targets(
    logits: torch.Tensor, labels: torch.Tensor, label_valid: torch.Tensor
) -> torch.Tensor:
    """Realised acceptance ratio per block [B, M] under greedy verification."""
    accepted = accepted_lengths(logits.argmax(-1), labels, label_valid)
    return acceptance_labels(accepted, label_valid.sum(-1))


def head_loss(
    head: LengthHead, hidden: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """MSE between predicted and realised ratios over valid blocks (hidden detached)."""
    pred = head(hidden.detach())
    err = (pred - ratio) ** 2 * mask
    return err.sum() / mask.sum().clamp_min(1)


def _blocks(drafter, target, seqs, num_drafts, num_anchors, generator):
    batch = make_batch(seqs, num_anchors=num_anchors, generator=generator)
    features, _ = target.features(
        batch.input_ids, drafter.target_layer_ids, batch.valid.long(), with_logits=False
    )
    with torch.no_grad():
        logits, hidden = student_logits(drafter, target, batch, features, num_drafts)
    labels, label_valid, _ = block_labels(batch, num_drafts)
    ratio = head_targets(logits, labels, label_valid)
    mask = (batch.anchor_valid & label_valid.any(-1)).float()
    return hidden, ratio, mask


def train_length_head(
    head: LengthHead,
    drafter,
    target,
    seqs: list[Sequence],
    *,
    num_drafts: int,
    epochs: int = 4,
    lr: float = 2e-3,
    batch_size: int = 8,
    num_anchors: int | None = 32,
    seed: int = 0,
) -> list[float]:
    """Fit the head to the (frozen) drafter's realised acceptance; returns losses."""
    drafter.eval()
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        for i in range(0, len(order), batch_size):
            chunk = [seqs[j] for j in order[i : i + batch_size]]
            hidden, ratio, mask = _blocks(
                drafter, target, chunk, num_drafts, num_anchors, gen
            )
            loss = head_loss(head, hidden, ratio, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@torch.no_grad()
def evaluate_length_head(
    head: LengthHead,
    drafter,
    target,
    seqs: list[Sequence],
    *,
    num_drafts: int,
    batch_size: int = 8,
) -> dict:
    """Calibration (MAE, ECE, and the MAE of a constant predictor) on `seqs`, every
    response position used as an anchor."""
    preds, reals = [], []
    for i in range(0, len(seqs), batch_size):
        hidden, ratio, mask = _blocks(
            drafter, target, seqs[i : i + batch_size], num_drafts, None, None
        )
        keep = mask.bool()
        preds.append(head(hidden)[keep])
        reals.append(ratio[keep])
    if not preds:
        return calibration(torch.empty(0), torch.empty(0))
    return calibration(torch.cat(preds), torch.cat(reals))
