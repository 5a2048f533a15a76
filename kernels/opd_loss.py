"""Fused Triton OPD loss: per-row CE, clipped reverse KL and the student-logit gradient.

The math, and the torch reference every result here is checked against, live in
`adaflash_vllm.training.losses`. This module streams the vocabulary in BLOCK_SIZE
chunks, so besides its inputs it writes only the [N, V] gradient (and only when the
student logits need one); the reference materialises about ten [N, V] fp32 tensors.

`@triton.jit` reads TRITON_INTERPRET when this module is imported: set it first to
run the kernels on CPU through the interpreter.

Shape symbols: N rows, V vocabulary, BLOCK_SIZE vocabulary chunk.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from adaflash_vllm.training.losses import LOG_P_FLOOR, OPDRows

# Whether the kernels below were decorated for the CPU interpreter (see docstring).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"

MAX_BLOCK_SIZE = 4096
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _opd_entries(zs, zt, lse_s, lse_t, LOG_P_FLOOR: tl.constexpr):
    # Shared by the sums pass and the gradient pass, so both see the same f_v and
    # therefore the same clipped set U.
    log_q = zs - lse_s
    log_p = tl.maximum(zt - lse_t, LOG_P_FLOOR)
    q = tl.exp(log_q)
    g = log_q - log_p
    f = q * g - q + tl.exp(log_p)
    return q, g, f


# One program per row; three streaming passes over V (fp32 throughout):
#
#   pass 1  m_s, d_s = online max / sum exp of z_s     ->  lse_s = m_s + log d_s
#           m_t, d_t = the same for z_t                ->  lse_t
#           y = argmax_v z_t, first index on ties (as torch.argmax)
#   pass 2  log q_v = z_s,v - lse_s,  log p_v = max(z_t,v - lse_t, LOG_P_FLOOR)
#           g_v = log q_v - log p_v,  f_v = q_v g_v - q_v + p_v  (>= 0)
#           U = {v : f_v <= delta}   (CLIP off: U = everything)
#           rkl = sum_{v in U} f_v + delta * |not U|,   clipped = |not U|
#           S   = sum_{v in U} q_v g_v
#           ce  = lse_s - z_s,y,   loss = alpha * ce + beta * rkl   (beta = 1 - alpha)
#   pass 3  (COMPUTE_GRAD) d loss / d z_s,u =
#               alpha * (q_u - [u == y])                  (HAS_CE:  alpha != 0)
#             + beta * q_u * (g_u [u in U] - S)           (HAS_RKL: alpha != 1)
#
# The gradient is for grad_output = 1; `opd_loss_backward` rescales it per row.
@triton.jit
def _opd_loss_kernel(
    student_ptr,  # [N, V] student logits
    teacher_ptr,  # [N, V] teacher logits
    grad_ptr,  # [N, V] d loss_n / d student logits (written iff COMPUTE_GRAD)
    loss_ptr,  # [N] fp32
    ce_ptr,  # [N] fp32
    rkl_ptr,  # [N] fp32
    clipped_ptr,  # [N] int64
    student_row_stride,
    teacher_row_stride,
    grad_row_stride,
    V,
    alpha,
    beta,
    delta,
    LOG_P_FLOOR: tl.constexpr,
    CLIP: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_RKL: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row = student_ptr + row * student_row_stride
    teacher_row = teacher_ptr + row * teacher_row_stride
    offsets = tl.arange(0, BLOCK_SIZE)

    # Pass 1: log-normalisers of both rows and the teacher's argmax.
    m_s = float("-inf")
    d_s = 0.0
    m_t = float("-inf")
    d_t = 0.0
    y = 0
    for start in range(0, V, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < V
        zs = tl.load(student_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        zt = tl.load(teacher_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_s, tl.max(zs, axis=0))
        d_s = d_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(zs - m_new), axis=0)
        m_s = m_new
        block_max, block_arg = tl.max(
            zt, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        # Strict '>' keeps the earlier chunk's index on a tie across chunks.
        y = tl.where(block_max > m_t, start + block_arg, y)
        m_new = tl.maximum(m_t, block_max)
        d_t = d_t * tl.exp(m_t - m_new) + tl.sum(tl.exp(zt - m_new), axis=0)
        m_t = m_new
    lse_s = m_s + tl.log(d_s)
    lse_t = m_t + tl.log(d_t)

    # Pass 2: clipped reverse KL, clip count and S. Masked lanes load 0 (finite) and
    # are dropped by the `where`s.
    rkl = 0.0
    num_clipped = 0
    s_sum = 0.0
    for start in range(0, V, BLOCK_SIZE):
        cols = start + offsets
        mask = cols < V
        zs = tl.load(student_row + cols, mask=mask, other=0.0).to(tl.float32)
        zt = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
        q, g, f = _opd_entries(zs, zt, lse_s, lse_t, LOG_P_FLOOR)
        if CLIP:
            over = f > delta
            num_clipped += tl.sum((over & mask).to(tl.int32), axis=0)
            f = tl.where(over, delta, f)
            keep = mask & (over == 0)
        else:
            keep = mask
        rkl += tl.sum(tl.where(mask, f, 0.0), axis=0)
        s_sum += tl.sum(tl.where(keep, q * g, 0.0), axis=0)

    ce = lse_s - tl.load(student_row + y).to(tl.float32)
    tl.store(loss_ptr + row, alpha * ce + beta * rkl)
    tl.store(ce_ptr + row, ce)
    tl.store(rkl_ptr + row, rkl)
    tl.store(clipped_ptr + row, num_clipped)  # cast to int64 by the store

    # Pass 3: the gradient, recomputing q, g and U chunk by chunk.
    if COMPUTE_GRAD:
        grad_row = grad_ptr + row * grad_row_stride
        for start in range(0, V, BLOCK_SIZE):
            cols = start + offsets
            mask = cols < V
            zs = tl.load(student_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RKL:
                zt = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
                q, g, f = _opd_entries(zs, zt, lse_s, lse_t, LOG_P_FLOOR)
                if CLIP:
                    g = tl.where(f > delta, 0.0, g)
                grad = beta * q * (g - s_sum)
            else:
                q = tl.exp(zs - lse_s)
                grad = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            if HAS_CE:
                grad += alpha * (q - tl.where(cols == y, 1.0, 0.0))
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


# grad_n,: *= grad_output_n, in place; rows whose grad_output is exactly 1 are
# left untouched (the usual case: an unweighted sum of the per-row losses).
@triton.jit
def _scale_rows_kernel(
    grad_ptr,  # [N, V]
    scale_ptr,  # [N] fp32
    grad_row_stride,
    V,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row)
    if scale != 1.0:
        grad_row = grad_ptr + row * grad_row_stride
        for start in range(0, V, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            mask = cols < V
            grad = tl.load(grad_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(
                grad_row + cols,
                (grad * scale).to(grad_ptr.dtype.element_ty),
                mask=mask,
            )


def _launch_config(vocab: int, block_size: int | None) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a vocabulary of `vocab` entries."""
    if block_size is None:
        block_size = min(MAX_BLOCK_SIZE, triton.next_power_of_2(vocab))
    assert block_size > 0 and block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two, got {block_size}"
    )
    return block_size, max(1, min(16, block_size // 256))


def _check_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "opd_loss expects student and teacher logits of the same shape [N, V], "
            f"got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if student_logits.device != teacher_logits.device:
        raise ValueError(
            f"logits on different devices: student {student_logits.device}, "
            f"teacher {teacher_logits.device}"
        )
    for name, t in (("student", student_logits), ("teacher", teacher_logits)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} logits have dtype {t.dtype}; use one of {_SUPPORTED_DTYPES}"
            )


def launch_opd_loss_kernel(
    *,
    student_logits: torch.Tensor,  # [N, V], unit stride along V
    teacher_logits: torch.Tensor,  # [N, V], unit stride along V
    loss: torch.Tensor,  # [N] fp32, written
    ce: torch.Tensor,  # [N] fp32, written
    rkl: torch.Tensor,  # [N] fp32, written
    clipped: torch.Tensor,  # [N] int64, written
    grad: torch.Tensor | None,  # [N, V] or None (no gradient pass), written
    alpha: float,
    delta: float,
    block_size: int | None = None,
) -> None:
    """Run `_opd_loss_kernel` into caller-owned buffers (tests pre-fill them)."""
    n, vocab = student_logits.shape
    if n == 0:
        return
    block, num_warps = _launch_config(vocab, block_size)
    compute_grad = grad is not None
    _opd_loss_kernel[(n,)](
        student_logits,
        teacher_logits,
        grad if compute_grad else loss,  # never dereferenced without COMPUTE_GRAD
        loss,
        ce,
        rkl,
        clipped,
        student_logits.stride(0),
        teacher_logits.stride(0),
        grad.stride(0) if compute_grad else 0,
        vocab,
        float(alpha),
        1.0 - float(alpha),
        float(delta),
        LOG_P_FLOOR=LOG_P_FLOOR,
        CLIP=delta != float("inf"),
        HAS_CE=alpha != 0.0,
        HAS_RKL=alpha != 1.0,
        COMPUTE_GRAD=compute_grad,
        BLOCK_SIZE=block,
        num_warps=num_warps,
    )


def opd_loss_forward(
    student_logits: torch.Tensor,  # [N, V]
    teacher_logits: torch.Tensor,  # [N, V]
    *,
    alpha: float,
    delta: float,
    compute_grad: bool,
    block_size: int | None = None,
) -> tuple[OPDRows, torch.Tensor | None]:
    """Per-row OPD terms and, if asked, d loss_n / d student logits ([N, V])."""
    _check_logits(student_logits, teacher_logits)
    # The kernel needs unit stride along V only; the row stride is free.
    if student_logits.stride(-1) != 1:
        student_logits = student_logits.contiguous()
    if teacher_logits.stride(-1) != 1:
        teacher_logits = teacher_logits.contiguous()
    n = student_logits.shape[0]
    new = student_logits.new_empty
    rows = OPDRows(
        loss=new(n, dtype=torch.float32),
        ce=new(n, dtype=torch.float32),
        rkl=new(n, dtype=torch.float32),
        clipped=new(n, dtype=torch.int64),
    )
    grad = torch.empty_like(student_logits) if compute_grad else None
    launch_opd_loss_kernel(
        student_logits=student_logits,
        teacher_logits=teacher_logits,
        loss=rows.loss,
        ce=rows.ce,
        rkl=rows.rkl,
        clipped=rows.clipped,
        grad=grad,
        alpha=alpha,
        delta=delta,
        block_size=block_size,
    )
    return rows, grad


def opd_loss_backward(
    grad: torch.Tensor,  # [N, V], from opd_loss_forward; scaled in place
    grad_output: torch.Tensor,  # [N] d L / d loss_n
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """Scale each gradient row by its grad_output, in place, and return it."""
    n, vocab = grad.shape
    if n == 0:
        return grad
    scale = grad_output.detach().to(device=grad.device, dtype=torch.float32)
    scale = scale.contiguous()
    block, num_warps = _launch_config(vocab, block_size)
    _scale_rows_kernel[(n,)](
        grad, scale, grad.stride(0), vocab, BLOCK_SIZE=block, num_warps=num_warps
    )
    return grad


class OPDLossFunction(torch.autograd.Function):
    """Per-row OPD loss with a fused gradient; the teacher is a constant.

    Returns (loss, ce, rkl, clipped), each [N]; only `loss` is differentiable. The
    gradient is computed during forward and stored (one [N, V] tensor in the student
    dtype); backward rescales it in place, so a graph can be backpropagated once.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        student_logits: torch.Tensor,  # [N, V]
        teacher_logits: torch.Tensor,  # [N, V]
        alpha: float,
        delta: float,
        block_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, grad = opd_loss_forward(
            student_logits,
            teacher_logits,
            alpha=alpha,
            delta=delta,
            compute_grad=ctx.needs_input_grad[0],
            block_size=block_size,
        )
        ctx.grad = grad
        ctx.block_size = block_size
        ctx.mark_non_differentiable(rows.ce, rows.rkl, rows.clipped)
        return rows.loss, rows.ce, rows.rkl, rows.clipped

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,  # [N]
        *_unused: torch.Tensor,
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        grad = ctx.grad
        if grad is None:
            raise RuntimeError(
                "OPDLossFunction.backward ran twice on one graph: its stored gradient "
                "is rescaled in place, so retain_graph=True backward is unsupported"
            )
        ctx.grad = None
        return (
            opd_loss_backward(grad, grad_loss, block_size=ctx.block_size),
            None,
            None,
            None,
            None,
        )


def opd_loss_rows_triton(
    student_logits: torch.Tensor,  # [N, V]
    teacher_logits: torch.Tensor,  # [N, V]
    *,
    alpha: float,
    delta: float,
    block_size: int | None = None,
) -> OPDRows:
    """Per-row OPD terms from the Triton kernel; `loss` carries the autograd graph."""
    loss, ce, rkl, clipped = OPDLossFunction.apply(
        student_logits, teacher_logits, alpha, delta, block_size
    )
    return OPDRows(loss=loss, ce=ce, rkl=rkl, clipped=clipped)
