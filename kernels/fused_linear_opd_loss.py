"""OPD loss straight from the drafter's hidden states: student logits are never whole.

The lm_head matmul, the OPD kernel and both gradient matmuls run on C rows at a time,
so the student side holds one [C, V] logits chunk and its gradient instead of two
[N, V] tensors. The teacher logits stay [N, V] (they come from the target model).

Because dL/dW mixes rows, per-row grad_output cannot be applied after the fact as
in `OPDLossFunction`: the row weights enter the forward, the Function returns the
scalar sum_n w_n loss_n, and backward scales the stored gradients by one scalar.

Shape symbols: N rows, H hidden size, V vocabulary, C rows per chunk.
"""

from __future__ import annotations

import dataclasses

import torch
from adaflash_vllm.kernels.opd_loss import launch_opd_loss_kernel, opd_loss_backward
from adaflash_vllm.training.losses import OPDLoss, OPDRows, reduce_opd_rows


class FusedLinearOPDLossFunction(torch.autograd.Function):
    """sum_n w_n loss_n of logits = hidden @ weight.T, plus detached per-row terms.

    Returns (loss_sum, loss, ce, rkl, clipped); only loss_sum ([]) is differentiable,
    the rest are [N]. Gradients for hidden and weight are computed in forward.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H], lm_head
        teacher_logits: torch.Tensor,  # [N, V]
        row_weights: torch.Tensor,  # [N] fp32
        alpha: float,
        delta: float,
        chunk_rows: int,
        block_size: int | None,
    ) -> tuple[torch.Tensor, ...]:
        n = hidden.shape[0]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = OPDRows(
            loss=hidden.new_empty(n, dtype=torch.float32),
            ce=hidden.new_empty(n, dtype=torch.float32),
            rkl=hidden.new_empty(n, dtype=torch.float32),
            clipped=hidden.new_empty(n, dtype=torch.int64),
        )
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulator: the sum over chunks would lose bits in bf16.
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            if need_weight
            else None
        )
        for start in range(0, n, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = hidden[chunk] @ weight.T  # [C, V]
            grad_logits = (
                torch.empty_like(logits) if need_hidden or need_weight else None
            )
            launch_opd_loss_kernel(
                student_logits=logits,
                teacher_logits=teacher_logits[chunk],
                loss=rows.loss[chunk],
                ce=rows.ce[chunk],
                rkl=rows.rkl[chunk],
                clipped=rows.clipped[chunk],
                grad=grad_logits,
                alpha=alpha,
                delta=delta,
                block_size=block_size,
            )
            if grad_logits is None:
                continue
            opd_loss_backward(grad_logits, row_weights[chunk], block_size=block_size)
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden[chunk]).float()
        ctx.grads = (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
        )
        loss_sum = (rows.loss * row_weights).sum()
        ctx.mark_non_differentiable(rows.loss, rows.ce, rows.rkl, rows.clipped)
        return loss_sum, rows.loss, rows.ce, rows.rkl, rows.clipped

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss_sum: torch.Tensor,  # []
        *_unused: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.grads
        if not torch.equal(grad_loss_sum, torch.ones_like(grad_loss_sum)):
            grad_hidden = None if grad_hidden is None else grad_hidden * grad_loss_sum
            grad_weight = None if grad_weight is None else grad_weight * grad_loss_sum
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_linear_opd_loss_triton(
    hidden: torch.Tensor,  # [N, H]
    lm_head_weight: torch.Tensor,  # [V, H]
    teacher_logits: torch.Tensor,  # [N, V]
    *,
    alpha: float,
    delta: float,
    weights: torch.Tensor | None = None,  # [N]; 0 = ignore the row
    chunk_rows: int = 1024,
    block_size: int | None = None,
) -> OPDLoss:
    """`OPDLoss` of logits = hidden @ lm_head_weight.T, chunk_rows rows at a time."""
    if hidden.dim() != 2 or lm_head_weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and lm_head_weight [V, H], got "
            f"{tuple(hidden.shape)} and {tuple(lm_head_weight.shape)}"
        )
    n, vocab = hidden.shape[0], lm_head_weight.shape[0]
    if teacher_logits.shape != (n, vocab):
        raise ValueError(
            f"teacher_logits must be [N, V] = {(n, vocab)}, "
            f"got {tuple(teacher_logits.shape)}"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    w = (
        torch.ones(n, device=hidden.device, dtype=torch.float32)
        if weights is None
        else weights.detach().float()
    )
    loss_sum, *fields = FusedLinearOPDLossFunction.apply(
        hidden, lm_head_weight, teacher_logits, w, alpha, delta, chunk_rows, block_size
    )
    stats = reduce_opd_rows(OPDRows(*fields), w, vocab)
    return dataclasses.replace(
        stats,
        loss=loss_sum / stats.weight_sum.clamp_min(1e-12),
        loss_sum=loss_sum,
    )
