"""The on-policy distillation (OPD) loss: hard-label CE plus entry-wise clipped
reverse KL. This torch code is the reference: the Triton kernel in
`adaflash_vllm.kernels.opd_loss`, its tests and its benchmark all compare to it.

Math (one row = one drafted block position; q = drafter/student, p = target):

    q = softmax(z_s)   p = softmax(z_t)   y = argmax_v p_v
    CE   = -log q_y
    f_v  = q_v (log q_v - log p_v) - q_v + p_v          (>= 0 for every v)
    RKL_delta = sum_v min(f_v, delta)
    loss = alpha * CE + (1 - alpha) * RKL_delta

Sign rule. The raw summand q_v log(q_v / p_v) is negative wherever q_v < p_v;
clipping raw summands (OPSD's pointwise clip) lets the clipped sum go negative and
can push q away from p (TRL PR #5990). We clip the Bregman form instead: adding
-q_v + p_v changes no total (sum q = sum p = 1), so sum_v f_v = KL(q || p) exactly,
but every entry is >= 0 and zero only at q_v = p_v, with df_v/dq_v = log(q_v/p_v).
An unclipped entry therefore always pulls q_v toward p_v; a clipped entry
(f_v > delta) is the constant delta and contributes no gradient. delta = inf gives
the plain reverse KL; alpha = 1 gives plain CE.

Gradient (U = unclipped entries, g_v = log q_v - log p_v):

    dCE/dz_u      = q_u - [u == y]
    dRKL_d/dz_u   = q_u * (g_u [u in U] - sum_{v in U} q_v g_v)

Target log-probs are floored at LOG_P_FLOOR so a zero-probability target entry
(e.g. a masked token) gives a large, clipped entry instead of inf/NaN.

Shape symbols: N rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_P_FLOOR = -100.0


@dataclass
class OPDRows:
    """Per-row terms of the OPD loss."""

    loss: torch.Tensor  # [N] alpha * ce + (1 - alpha) * rkl
    ce: torch.Tensor  # [N]
    rkl: torch.Tensor  # [N] clipped reverse KL
    clipped: torch.Tensor  # [N] number of entries with f_v > delta (int)


def opd_loss_rows_reference(
    student_logits: torch.Tensor,  # [N, V]
    teacher_logits: torch.Tensor,  # [N, V]
    *,
    alpha: float,
    delta: float,
) -> OPDRows:
    """Reference per-row OPD loss in fp32 (autograd gives the gradient)."""
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1).clamp_min(LOG_P_FLOOR)
    q, p = log_q.exp(), log_p.exp()
    y = teacher_logits.argmax(dim=-1, keepdim=True)
    ce = -log_q.gather(-1, y).squeeze(-1)
    f = q * (log_q - log_p) - q + p
    over = f > delta
    rkl = torch.where(over, torch.full_like(f, delta), f).sum(-1)
    loss = alpha * ce + (1.0 - alpha) * rkl
    return OPDRows(loss=loss, ce=ce, rkl=rkl, clipped=over.sum(-1))


@dataclass
class OPDLoss:
    """Weighted OPD loss plus the (sum, count) pairs data-parallel ranks all-reduce."""

    loss: torch.Tensor  # scalar: loss_sum / weight_sum
    loss_sum: torch.Tensor  # scalar, differentiable
    weight_sum: torch.Tensor  # scalar
    ce_sum: torch.Tensor  # scalar, detached, weighted
    rkl_sum: torch.Tensor  # scalar, detached, weighted
    clipped_entries: torch.Tensor  # scalar int over rows with weight > 0
    total_entries: int
    clipped_rows: torch.Tensor  # rows with at least one clipped entry

    @property
    def clip_fraction(self) -> float:
        return float(self.clipped_entries) / max(1, self.total_entries)


def reduce_opd_rows(rows: OPDRows, weights: torch.Tensor | None, vocab: int) -> OPDLoss:
    """Weighted mean of per-row terms; rows with weight 0 are ignored everywhere."""
    w = torch.ones_like(rows.loss) if weights is None else weights.float()
    active = w > 0
    weight_sum = w.sum()
    loss_sum = (rows.loss * w).sum()
    return OPDLoss(
        loss=loss_sum / weight_sum.clamp_min(1e-12),
        loss_sum=loss_sum,
        weight_sum=weight_sum.detach(),
        ce_sum=(rows.ce * w).sum().detach(),
        rkl_sum=(rows.rkl * w).sum().detach(),
        clipped_entries=rows.clipped[active].sum(),
        total_entries=int(active.sum()) * vocab,
        clipped_rows=(rows.clipped[active] > 0).sum(),
    )


def opd_loss_reference(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float = 0.8,
    delta: float = 0.01,
    weights: torch.Tensor | None = None,  # [N], e.g. position decay; 0 = ignore
) -> OPDLoss:
    """The OPD loss over rows, computed entirely in torch."""
    rows = opd_loss_rows_reference(
        student_logits, teacher_logits, alpha=alpha, delta=delta
    )
    return reduce_opd_rows(rows, weights, student_logits.shape[-1])


def position_decay_weights(num_drafts: int, gamma: float) -> torch.Tensor:
    """DFlash loss decay w_k = exp(-(k - 1) / gamma) for draft positions k = 1..K."""
    k = torch.arange(num_drafts, dtype=torch.float32)
    return torch.exp(-k / gamma)
