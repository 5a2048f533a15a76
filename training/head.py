"""Training and evaluating the length head (proposers/length_head.py).

Labels come from the recomputed target along the sequence for the whole block of
K: the number of leading drafts that greedy verification accepts, over the block's
valid slots. They are not limited to the prefix the head itself let through when
serving, so the head's own truncation does not bias them. The head trains on
detached drafter hidden states and confidence features, so it never changes the
drafter.

Losses, per valid block with a accepted drafts out of n valid slots:

    survival head (conditional acceptance g_k = sigmoid(c_k), slots k = 0..K-1):
        -log P(a) = -sum_{k < a} log g_k - [a < n] log(1 - g_a)
      the exact likelihood of the realised length (a block cut short by the end of
      the sequence, a = n < K, is censored: no rejection term);
    ratio head: (a_hat - a / n)^2.

A head with history (`length_head.round_history`) reads the request's previous
round, so it trains and is scored on blocks where serving would draft them: along
served chains (`served_chains`), each round starting right after the last one's
accepted drafts and bonus token. Its training chains also cut rounds short at
random budgets, as cost-aware serving does, so it learns what a budget-capped
count (a' = k' < K) says; every position also trains once without a previous
round (a request's first round, or one after a step without a draft).

Shape symbols: B sequences, M anchors, K drafts per block, H hidden, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from adaflash_vllm.proposers.budget import geometric_survival
from adaflash_vllm.proposers.length_head import (
    LengthHead,
    acceptance_labels,
    calibration,
    draft_confidence,
    round_history,
)
from adaflash_vllm.training.blocks import (
    accepted_lengths,
    block_labels,
    make_batch,
    student_logits,
)
from adaflash_vllm.training.data import Sequence
from tqdm import tqdm

CHAINS = 4  # served chains per training sequence for a head with history
CUT_SHARE = 0.3  # rounds of the chains after the first cut at a random budget


def head_targets(
    logits: torch.Tensor, labels: torch.Tensor, label_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [B, M] under greedy verification, valid slots [B, M])."""
    accepted = accepted_lengths(logits.argmax(-1), labels, label_valid)
    return accepted, label_valid.sum(-1)


def survival_nll(
    cond_logits: torch.Tensor,  # [B, M, K] conditional acceptance logits
    accepted: torch.Tensor,  # [B, M]
    valid_slots: torch.Tensor,  # [B, M]
) -> torch.Tensor:
    """-log P(accepted length) per block [B, M] (module docstring)."""
    k = torch.arange(cond_logits.shape[-1], device=cond_logits.device)
    a, n = accepted.unsqueeze(-1), valid_slots.unsqueeze(-1)
    took = (k < a).float()
    refused = ((k == a) & (a < n)).float()
    return -(
        F.logsigmoid(cond_logits) * took + F.logsigmoid(-cond_logits) * refused
    ).sum(-1)


def _valid_slots_mask(survival: torch.Tensor, valid_slots: torch.Tensor):
    """[B, M, K]: which of each block's K slots are valid (the first n)."""
    k = torch.arange(survival.shape[-1], device=survival.device)
    return k < valid_slots.unsqueeze(-1)


def _survival_ratio(survival: torch.Tensor, valid_slots: torch.Tensor) -> torch.Tensor:
    """Expected accepted fraction of each block's valid slots [B, M] from s
    [B, M, K] (a block cut short by the sequence end has fewer than K)."""
    inside = _valid_slots_mask(survival, valid_slots).float()
    return (survival * inside).sum(-1) / valid_slots.float().clamp_min(1)


def predicted_ratio(
    head: LengthHead,
    hidden: torch.Tensor,
    confidence: torch.Tensor,
    valid_slots: torch.Tensor,
) -> torch.Tensor:
    """The head's predicted accepted fraction of each block's valid slots [B, M]."""
    if head.kind == "survival":
        return _survival_ratio(head.survival(hidden, confidence), valid_slots)
    return head.ratio(hidden)


def _median_length(survival: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """[B, M]: each block's median accepted length (`median_ratio`), in slots."""
    return ((survival >= 0.5) & inside).sum(-1)


def median_ratio(survival: torch.Tensor, valid_slots: torch.Tensor) -> torch.Tensor:
    """The median of each block's predicted accepted length, as a fraction of its
    valid slots [B, M], from s [B, M, K] with s_j = P(at least j + 1 accepted).

    The median m is the largest length with P(A >= m) >= 1/2 (then P(A <= m) >=
    1/2 too): the count of valid slots whose survival is at least 1/2, since s is
    non-increasing. Under absolute error the median is the best point forecast
    (the mean is best under squared error), so MAE is scored on it."""
    m = _median_length(survival, _valid_slots_mask(survival, valid_slots))
    return m.float() / valid_slots.float().clamp_min(1)


def expected_median_error(
    survival: torch.Tensor, valid_slots: torch.Tensor
) -> torch.Tensor:
    """The absolute error of each block's median forecast (`median_ratio`) that
    its own predicted distribution expects, E|A - m| / n [B, M], from s [B, M, K]
    (n valid slots). Where the head is calibrated this is the MAE the head's
    information allows: a realised MAE near it says a sharper forecast needs
    new inputs, not a better fit of these."""
    inside = _valid_slots_mask(survival, valid_slots)
    s = (survival * inside).float()
    ones = s.new_ones(*s.shape[:-1], 1)
    at_least = torch.cat([ones, s, torch.zeros_like(ones)], -1)  # P(A >= j), j=0..K+1
    pmf = at_least[..., :-1] - at_least[..., 1:]  # P(A = j), j = 0..K
    m = _median_length(survival, inside).unsqueeze(-1)
    j = torch.arange(survival.shape[-1] + 1, device=survival.device)
    return (pmf * (j - m).abs()).sum(-1) / valid_slots.float().clamp_min(1)


class HeadLoss(NamedTuple):
    loss: torch.Tensor  # the training loss over the valid blocks
    mse: float  # of the predicted mean ratio, for logs
    # absolute error of the point forecast (a survival head's median, a ratio
    # head's mean) summed over the blocks of `scored`, and how many there were
    abs_error: float
    scored: int
    # the scored blocks' predicted mean and realised accepted fraction [N]
    scored_mean: torch.Tensor
    scored_real: torch.Tensor


def head_loss(
    head: LengthHead,
    hidden: torch.Tensor,  # [B, M, K, H] drafter outputs at the masks
    confidence: torch.Tensor,  # [B, M, K, 3] draft_confidence of its logits
    accepted: torch.Tensor,  # [B, M]
    valid_slots: torch.Tensor,  # [B, M]
    mask: torch.Tensor,  # [B, M] 1.0 for blocks that count
    history: torch.Tensor | None = None,  # [B, M, 3] round_history, or none
    scored: torch.Tensor | None = None,  # [B, M] bool: blocks the MAE scores
) -> HeadLoss:
    """The head's training loss over valid blocks, its MSE, and its absolute
    error on the valid blocks of `scored` (default: all). Inputs are detached
    here: the head never trains the drafter."""
    hidden, confidence = hidden.detach(), confidence.detach()
    ratio = acceptance_labels(accepted, valid_slots)
    denom = mask.sum().clamp_min(1)
    if head.kind == "survival":
        cond = head.logits(hidden, confidence, history)
        loss = (survival_nll(cond, accepted, valid_slots) * mask).sum() / denom
        with torch.no_grad():
            survival = torch.sigmoid(cond).cumprod(-1)
            pred = _survival_ratio(survival, valid_slots)
            point = median_ratio(survival, valid_slots)
    else:
        pred = head.ratio(hidden)
        loss = ((pred - ratio) ** 2 * mask).sum() / denom
        point = pred.detach()
    mse = float((((pred.detach() - ratio) ** 2) * mask).sum() / denom)
    keep = mask > 0 if scored is None else (mask > 0) & scored
    abs_error = float((point - ratio).abs()[keep].sum())
    return HeadLoss(
        loss,
        mse,
        abs_error,
        int(keep.sum()),
        pred.detach()[keep].float().cpu(),
        ratio[keep].float().cpu(),
    )


def _blocks(drafter, target, seqs, num_drafts, num_anchors, generator):
    batch = make_batch(seqs, num_anchors=num_anchors, generator=generator)
    features, _ = target.features(
        batch.input_ids, drafter.target_layer_ids, batch.valid.long(), with_logits=False
    )
    with torch.no_grad():
        logits, hidden = student_logits(drafter, target, batch, features, num_drafts)
        confidence = draft_confidence(logits)
    labels, label_valid, _ = block_labels(batch, num_drafts)
    accepted, valid_slots = head_targets(logits, labels, label_valid)
    mask = (batch.anchor_valid & label_valid.any(-1)).float()
    return hidden, confidence, accepted, valid_slots, mask


def served_chains(
    accepted: list[int],
    num_drafts: int,
    *,
    chains: int = 1,
    cut_share: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int, int]]:
    """Rounds of served chains over one sequence whose block at response offset i
    accepts `accepted[i]` drafts (greedy verification of all K): (offset, previous
    round's accepted a', its verified k'), k' = 0 on a chain's first round.

    The first chain verifies all K every round; each later one cuts a round short
    with probability `cut_share`, at k ~ U{1..K} (as budgets do), so its next
    round starts earlier. Repeated (offset, a', k') rounds are kept once."""
    seen: dict[tuple[int, int, int], None] = {}
    for c in range(chains):
        i, prev = 0, (0, 0)
        while i < len(accepted):
            seen.setdefault((i, *prev))
            k = num_drafts
            if c and float(torch.rand((), generator=generator)) < cut_share:
                k = int(torch.randint(1, num_drafts + 1, (), generator=generator))
            a = min(accepted[i], k)
            prev, i = (a, k), i + a + 1
    return list(seen)


def _chain_rows(
    accepted: torch.Tensor,  # [B, M] every response position an anchor
    mask: torch.Tensor,  # [B, M]
    num_drafts: int,
    *,
    every: bool = False,
    **chain_args,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence [R], anchor index [R], history [R, 3]) of the served chains'
    rounds of every sequence in a batch made with every position an anchor;
    with `every`, also every other position as a block without a previous round
    (u = 0), as on a request's first round or after a step without a draft."""
    seq, idx, acc, ver = [], [], [], []
    for b in range(accepted.shape[0]):
        n = int(mask[b].sum())  # valid anchors lead, in position order
        rounds = served_chains(accepted[b, :n].tolist(), num_drafts, **chain_args)
        if every:
            rounds = list(dict.fromkeys(rounds + [(i, 0, 0) for i in range(n)]))
        for i, a, k in rounds:
            seq.append(b), idx.append(i), acc.append(a), ver.append(k)
    history = round_history(torch.tensor(acc), torch.tensor(ver), num_drafts)
    return torch.tensor(seq, dtype=torch.long), torch.tensor(idx), history


@torch.no_grad()
def _head_inputs(
    head: LengthHead,
    drafter,
    target,
    seqs: list[Sequence],
    *,
    num_drafts: int,
    batch_size: int,
    num_anchors: int | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's inputs x [N, F], accepted [N] and valid slots [N] of every
    valid block of `seqs` (one drafter pass: the head then trains on these). A
    head with history takes the rounds of `CHAINS` served chains per sequence,
    each reading its previous round, and every position once without one (the
    drafter then runs at every position, whatever `num_anchors`)."""
    xs, accs, valids = [], [], []
    for i in tqdm(
        range(0, len(seqs), batch_size),
        desc="length head: blocks",
        unit="batch",
        disable=len(seqs) < 64,
    ):
        hidden, confidence, accepted, valid_slots, mask = _blocks(
            drafter,
            target,
            seqs[i : i + batch_size],
            num_drafts,
            None if head.history else num_anchors,
            generator,
        )
        conf = confidence if head.needs_confidence else None
        if head.history:
            b, m, history = _chain_rows(
                accepted,
                mask,
                num_drafts,
                every=True,
                chains=CHAINS,
                cut_share=CUT_SHARE,
                generator=generator,
            )
            xs.append(head.inputs(hidden[b, m], confidence[b, m], history))
            accs.append(accepted[b, m])
            valids.append(valid_slots[b, m])
            continue
        keep = mask.bool()
        xs.append(head.inputs(hidden, conf)[keep])
        accs.append(accepted[keep])
        valids.append(valid_slots[keep])
    return torch.cat(xs), torch.cat(accs), torch.cat(valids)


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
    block_batch: int = 1024,
    seed: int = 0,
) -> list[float]:
    """Fit the head to the (frozen) drafter's realised acceptance; returns losses.

    The drafter runs once over `seqs` (`batch_size` sequences at a time,
    `num_anchors` random blocks per sequence, None = every position); the head
    then trains `epochs` passes over those blocks, `block_batch` at a time."""
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    x, accepted, valid_slots = _head_inputs(
        head,
        drafter,
        target,
        seqs,
        num_drafts=num_drafts,
        batch_size=batch_size,
        num_anchors=num_anchors,
        generator=gen,
    )
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    ratio = acceptance_labels(accepted, valid_slots)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0], block_batch):
            idx = order[i : i + block_batch]
            out = head.mlp(x[idx])
            if head.kind == "survival":
                loss = survival_nll(out, accepted[idx], valid_slots[idx]).mean()
            else:
                loss = ((torch.sigmoid(out.squeeze(-1)) - ratio[idx]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    head.eval()
    return losses


BUDGET_FRACTIONS = (0.15, 0.3, 0.5)
BUDGET_GROUP = 32  # blocks per simulated step


def budget_recall(
    survival: torch.Tensor,  # [N, K] predicted survival per block
    accepted: torch.Tensor,  # [N] realised accepted drafts
    *,
    fractions: tuple[float, ...] = BUDGET_FRACTIONS,
    group: int = BUDGET_GROUP,
) -> dict[str, float]:
    """How well a survival estimate spends a verification budget: in groups of
    `group` blocks (one simulated step), verify the `fraction * group * K` slots
    with the highest predicted survival (a prefix per block, as cost_aware does)
    and count the drafts accepted within them, as a share of what an oracle that
    knows every block's accepted length gets from the same budget."""
    n, k = survival.shape
    n -= n % group
    if n == 0:
        return {}
    # Steps mix blocks of different requests: shuffle (fixed seed) before grouping.
    order = torch.randperm(
        survival.shape[0], generator=torch.Generator().manual_seed(0)
    )
    s = survival[order[:n]].float().reshape(-1, group * k)
    acc = accepted[order[:n]].float().reshape(-1, group)
    rank = torch.arange(k, dtype=torch.float32)
    # The oracle's survivals: 1 up to the accepted length (ties broken by slot).
    oracle = (rank < acc.unsqueeze(-1)).float().reshape(-1, group * k)
    out = {}
    for f in fractions:
        budget = max(1, int(f * group * k))

        def got(scores: torch.Tensor, budget=budget) -> float:
            # Later slots rank lower on ties, so each block's choice is a prefix.
            tie = (rank * 1e-6).repeat(group)
            top = (scores - tie).topk(budget, dim=-1).indices
            chosen = torch.zeros_like(scores).scatter_(1, top, 1.0)
            k_i = chosen.view(-1, group, k).sum(-1)
            return float(torch.minimum(acc, k_i).sum())

        out[f"{f:g}"] = got(s) / max(got(oracle), 1e-9)
    return out


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
    """Calibration on `seqs`, every response position an anchor (`calibration`):
    `mae` scores a survival head's median forecast (a ratio head's mean, the only
    forecast it makes), `mae_mean` the mean, against the best constant
    (`mae_constant`, the realised median) and the realised mean; ECE; and the
    budget recall; for a survival head also `mae_expected`, the MAE its own
    predicted distributions expect of its median forecast
    (`expected_median_error`). `served` is the same calibration on the rounds of
    one served chain per sequence (all K verified), the blocks serving drafts: a
    head with history reads each one's previous round there (and none at every
    position)."""
    preds, medians, expected, reals, head_s, conf_s, accs = [], [], [], [], [], [], []
    served: dict[str, list[torch.Tensor]] = {
        "pred": [],
        "median": [],
        "expected": [],
        "real": [],
    }
    for i in range(0, len(seqs), batch_size):
        hidden, confidence, accepted, valid_slots, mask = _blocks(
            drafter, target, seqs[i : i + batch_size], num_drafts, None, None
        )
        keep = mask.bool()
        pred = predicted_ratio(head, hidden, confidence, valid_slots)
        preds.append(pred[keep])
        reals.append(acceptance_labels(accepted, valid_slots)[keep])
        full = keep & (valid_slots == num_drafts)  # budgets see whole blocks
        if head.kind == "survival":
            survival = head.survival(hidden, confidence)
        else:
            survival = geometric_survival(head.ratio(hidden), num_drafts)
        if head.kind == "survival":  # a ratio head predicts only a mean
            medians.append(median_ratio(survival, valid_slots)[keep])
            expected.append(expected_median_error(survival, valid_slots)[keep])
        head_s.append(survival[full])
        conf_s.append(confidence[..., 0].exp().cumprod(-1)[full])
        accs.append(accepted[full])
        _served_round(head, served, hidden, confidence, accepted, valid_slots, mask)
    if not preds:
        return calibration(torch.empty(0), torch.empty(0))
    median = torch.cat(medians) if medians else None
    result = calibration(torch.cat(preds), torch.cat(reals), median=median)
    if expected:
        result["mae_expected"] = torch.cat(expected).mean().item()
    acc = torch.cat(accs)
    result["budget_recall"] = budget_recall(torch.cat(head_s), acc)
    result["budget_recall_confidence"] = budget_recall(torch.cat(conf_s), acc)
    result["served"] = calibration(
        torch.cat(served["pred"]),
        torch.cat(served["real"]),
        median=torch.cat(served["median"]) if served["median"] else None,
    )
    if served["expected"]:
        result["served"]["mae_expected"] = torch.cat(served["expected"]).mean().item()
    return result


def _served_round(head, served, hidden, confidence, accepted, valid_slots, mask):
    """Add one batch's served-chain rounds to `served` (evaluate_length_head)."""
    b, m, history = _chain_rows(accepted, mask, hidden.shape[-2])
    if not head.history:
        history = None
    valid = valid_slots[b, m]
    served["real"].append(acceptance_labels(accepted[b, m], valid))
    if head.kind != "survival":
        served["pred"].append(head.ratio(hidden[b, m]))
        return
    survival = head.survival(hidden[b, m], confidence[b, m], history)
    served["pred"].append(_survival_ratio(survival, valid))
    served["median"].append(median_ratio(survival, valid))
    served["expected"].append(expected_median_error(survival, valid))
