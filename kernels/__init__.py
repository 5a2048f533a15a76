"""Triton kernels for the distillation math, each with a torch reference."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import torch
from adaflash_vllm.training.losses import (
    OPDLoss,
    OPDRows,
    opd_loss_reference,
    opd_loss_rows_reference,
    reduce_opd_rows,
)

# The kernel modules share their names with the public functions below. Importing
# them first means the functions, defined later, keep the package attributes: a later
# `import adaflash_vllm.kernels.opd_loss` finds the module in sys.modules and does
# not rebind it. Without triton the modules are absent and only the torch path runs.
try:
    from adaflash_vllm.kernels import fused_linear_opd_loss as _fused_module
    from adaflash_vllm.kernels import opd_loss as _opd_loss_module
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    _fused_module = _opd_loss_module = None

__all__ = ["Backend", "fused_linear_opd_loss", "opd_loss", "opd_loss_rows"]

# "auto": Triton for CUDA tensors when triton is installed, the torch reference
# otherwise. "triton" also runs CPU tensors under TRITON_INTERPRET=1 (tests).
Backend = Literal["auto", "triton", "torch"]


def _check_interpreted(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not _opd_loss_module.INTERPRETED:
        raise RuntimeError(
            "backend='triton' got CPU tensors but adaflash_vllm.kernels.opd_loss was "
            "imported without TRITON_INTERPRET=1; set it before that import"
        )


def _opd_rows_triton(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float,
    delta: float,
) -> OPDRows:
    _check_interpreted(student_logits)
    return _opd_loss_module.opd_loss_rows_triton(
        student_logits, teacher_logits, alpha=alpha, delta=delta
    )


_OPD_ROW_BACKENDS: dict[str, Callable[..., OPDRows]] = {
    "triton": _opd_rows_triton,
    "torch": opd_loss_rows_reference,
}


def _triton_installed() -> bool:
    return _opd_loss_module is not None


def _resolve_backend(backend: Backend, logits: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if logits.is_cuda and _triton_installed() else "torch"
    if backend not in _OPD_ROW_BACKENDS:
        choices = ", ".join(map(repr, ["auto", *_OPD_ROW_BACKENDS]))
        raise ValueError(f"backend={backend!r}; use one of {choices}")
    if backend == "triton":
        if not _triton_installed():
            raise ImportError(
                "backend='triton' needs the triton package; pip install triton"
            )
        if not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA logits (got {logits.device}) or "
                "TRITON_INTERPRET=1 for the CPU interpreter"
            )
    return backend


def opd_loss_rows(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float,
    delta: float,
    backend: Backend = "auto",
) -> OPDRows:
    """Per-row OPD terms: loss (differentiable w.r.t. the student), ce, rkl, clipped.

    Args:
        student_logits: drafter logits, fp32 / bf16 / fp16.
        teacher_logits: target logits, same shape; treated as a constant.
        alpha: CE weight; the clipped reverse KL gets 1 - alpha.
        delta: per-entry clip of the Bregman-form RKL; `float("inf")` = plain RKL.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".

    Returns:
        `OPDRows`, each field [N]; `clipped` is int64.

    Shape:
        student_logits, teacher_logits: [N, V].

    Example:
        >>> rows = opd_loss_rows(z_s, z_t, alpha=0.8, delta=0.01)
        >>> (rows.loss * weights).sum().backward()
    """
    run = _OPD_ROW_BACKENDS[_resolve_backend(backend, student_logits)]
    return run(student_logits, teacher_logits, alpha=alpha, delta=delta)


def opd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float = 0.8,
    delta: float = 0.01,
    weights: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> OPDLoss:
    """Weighted OPD loss (alpha * CE + (1 - alpha) * clipped RKL) over rows.

    Args:
        student_logits: drafter logits, fp32 / bf16 / fp16.
        teacher_logits: target logits, same shape; treated as a constant.
        alpha: CE weight; the clipped reverse KL gets 1 - alpha.
        delta: per-entry clip of the Bregman-form RKL; `float("inf")` = plain RKL.
        weights: per-row weights (e.g. position decay); 0 ignores a row.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".

    Returns:
        `OPDLoss`: `loss` and `loss_sum` are differentiable; the rest are the
        (sum, count) statistics that data-parallel ranks all-reduce.

    Shape:
        student_logits, teacher_logits: [N, V]; weights: [N].

    Example:
        >>> out = opd_loss(z_s, z_t, alpha=0.8, delta=0.01, weights=w)
        >>> out.loss.backward()
    """
    rows = opd_loss_rows(
        student_logits, teacher_logits, alpha=alpha, delta=delta, backend=backend
    )
    return reduce_opd_rows(rows, weights, student_logits.shape[-1])


def _fused_linear_triton(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_logits: torch.Tensor,
    **kwargs: object,
) -> OPDLoss:
    _check_interpreted(hidden)
    return _fused_module.fused_linear_opd_loss_triton(
        hidden, lm_head_weight, teacher_logits, **kwargs
    )


def _fused_linear_torch(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    chunk_rows: int,
    **kwargs: object,
) -> OPDLoss:
    del chunk_rows  # the reference materialises all logits at once
    return opd_loss_reference(hidden @ lm_head_weight.T, teacher_logits, **kwargs)


_FUSED_LINEAR_BACKENDS: dict[str, Callable[..., OPDLoss]] = {
    "triton": _fused_linear_triton,
    "torch": _fused_linear_torch,
}


def fused_linear_opd_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    alpha: float = 0.8,
    delta: float = 0.01,
    weights: torch.Tensor | None = None,
    chunk_rows: int = 1024,
    backend: Backend = "auto",
) -> OPDLoss:
    """`opd_loss` of logits = hidden @ lm_head_weight.T without materialising them.

    The Triton path runs the lm_head matmul, the OPD kernel and the gradient matmuls
    on `chunk_rows` rows at a time; the torch path is `opd_loss_reference` on the
    full logits.

    Args:
        hidden: drafter hidden states before the lm_head.
        lm_head_weight: the drafter's (often shared) lm_head weight.
        teacher_logits: target logits; treated as a constant.
        alpha, delta, weights, backend: as in `opd_loss`.
        chunk_rows: rows per chunk (C); memory is O(C * V) on the student side.

    Returns:
        `OPDLoss`; `loss` and `loss_sum` backpropagate into hidden and the weight.

    Shape:
        hidden: [N, H]; lm_head_weight: [V, H]; teacher_logits: [N, V]; weights: [N].

    Example:
        >>> out = fused_linear_opd_loss(h, lm_head.weight, z_t, weights=w)
        >>> out.loss.backward()
    """
    run = _FUSED_LINEAR_BACKENDS[_resolve_backend(backend, hidden)]
    return run(
        hidden,
        lm_head_weight,
        teacher_logits,
        alpha=alpha,
        delta=delta,
        weights=weights,
        chunk_rows=chunk_rows,
    )
