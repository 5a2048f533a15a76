"""The fused Triton OPD loss against the torch reference in training/losses.py.

Runs on a CUDA GPU, or on CPU through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 unless it is already set; use TRITON_INTERPRET=0 on a GPU host to
test the compiled kernel):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_opd_loss.py -q

Shapes stay small because the interpreter runs one program at a time in numpy.
Shape symbols: N rows, V vocabulary.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the OPD kernel needs triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET),
    reason="needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter",
)

import adaflash_vllm.kernels as kernels  # noqa: E402
from adaflash_vllm.kernels import (  # noqa: E402
    fused_linear_opd_loss,
    opd_loss,
    opd_loss_rows,
)
from adaflash_vllm.kernels.opd_loss import (  # noqa: E402
    launch_opd_loss_kernel,
    opd_loss_rows_triton,
)
from adaflash_vllm.training.losses import (  # noqa: E402
    OPDRows,
    opd_loss_reference,
    opd_loss_rows_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64  # small chunks, so every row streams through several of them

# name -> (N, V)
_SHAPES = {
    "single_row": (1, 128),  # V a multiple of BLOCK: no masked tail
    "odd_rows_ragged_vocab": (7, 300),  # 300 = 4 * 64 + 44: masked tail chunk
    "vocab_below_block": (3, 50),  # one partial chunk
}
# name -> (dtype, forward tolerance, gradient tolerance). Both paths compute in fp32
# from the same inputs; a bf16 gradient may round one bf16 ulp apart.
_DTYPES = {
    "fp32": (torch.float32, dict(atol=1e-5, rtol=1e-5), dict(atol=1e-6, rtol=1e-4)),
    "bf16": (torch.bfloat16, dict(atol=2e-5, rtol=2e-5), dict(atol=1e-5, rtol=1.6e-2)),
}
_ALPHAS = [0.0, 0.8, 1.0]
_DELTAS = {"clip": 0.01, "no_clip": float("inf")}


def _logits(
    n: int, v: int, dtype: torch.dtype, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random student and teacher logits, [N, V] each, far enough apart to clip."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(n, v, generator=gen) * 2.0
    teacher = torch.randn(n, v, generator=gen) * 2.0
    return student.to(DEVICE, dtype), teacher.to(DEVICE, dtype)


def _row_weights(n: int, *, seed: int = 1) -> torch.Tensor:
    """Per-row grad_output != 1, with the middle row ignored (weight 0)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=gen) + 0.25
    w[n // 2] = 0.0
    return w.to(DEVICE)


def _reference(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    alpha: float,
    delta: float,
) -> tuple[OPDRows, torch.Tensor]:
    """Reference rows and the autograd gradient of sum_n w_n loss_n."""
    student = student.detach().clone().requires_grad_()
    rows = opd_loss_rows_reference(student, teacher, alpha=alpha, delta=delta)
    _weighted_sum(rows.loss, weights).backward()
    return rows, student.grad


def _kernel(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    alpha: float,
    delta: float,
    block_size: int | None = BLOCK,
) -> tuple[OPDRows, torch.Tensor]:
    """Kernel rows and its gradient of sum_n w_n loss_n."""
    student = student.detach().clone().requires_grad_()
    rows = opd_loss_rows_triton(
        student, teacher, alpha=alpha, delta=delta, block_size=block_size
    )
    _weighted_sum(rows.loss, weights).backward()
    return rows, student.grad


def _weighted_sum(loss: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return loss.sum() if weights is None else (loss * weights).sum()


def _assert_rows_close(got: OPDRows, want: OPDRows, tol: dict) -> None:
    for name in ("loss", "ce", "rkl"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), **tol)
    assert got.clipped.dtype == torch.int64, got.clipped.dtype
    assert torch.equal(got.clipped, want.clipped), (got.clipped, want.clipped)


@pytest.mark.parametrize("delta", _DELTAS.values(), ids=_DELTAS.keys())
@pytest.mark.parametrize("alpha", _ALPHAS)
@pytest.mark.parametrize("dtype_name", _DTYPES)
@pytest.mark.parametrize("shape", _SHAPES.values(), ids=_SHAPES.keys())
def test_rows_and_weighted_grad_match_reference(shape, dtype_name, alpha, delta):
    """Every per-row term and the gradient under per-row grad_output match autograd."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    student, teacher = _logits(*shape, dtype)
    weights = _row_weights(shape[0])
    want, want_grad = _reference(student, teacher, weights, alpha=alpha, delta=delta)
    got, got_grad = _kernel(student, teacher, weights, alpha=alpha, delta=delta)

    _assert_rows_close(got, want, fwd_tol)
    assert got_grad.dtype == dtype, got_grad.dtype
    torch.testing.assert_close(got_grad, want_grad, **grad_tol)
    if alpha == 1.0:
        torch.testing.assert_close(got.loss, got.ce, atol=0, rtol=0)
    if alpha == 0.0:
        torch.testing.assert_close(got.loss, got.rkl, atol=0, rtol=0)


@pytest.mark.parametrize("dtype_name", _DTYPES)
@pytest.mark.parametrize("shape", _SHAPES.values(), ids=_SHAPES.keys())
def test_unit_grad_output_matches_reference(shape, dtype_name):
    """grad_output == 1 (a plain sum) skips the rescale and still matches autograd."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    student, teacher = _logits(*shape, dtype, seed=2)
    want, want_grad = _reference(student, teacher, None, alpha=0.8, delta=0.01)
    got, got_grad = _kernel(student, teacher, None, alpha=0.8, delta=0.01)
    _assert_rows_close(got, want, fwd_tol)
    torch.testing.assert_close(got_grad, want_grad, **grad_tol)


@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_public_opd_loss_matches_reference(dtype_name):
    """opd_loss(backend="triton") gives the reference OPDLoss, weights included."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    student, teacher = _logits(5, 300, dtype, seed=3)
    weights = _row_weights(5)
    ref_student = student.clone().requires_grad_()
    want = opd_loss_reference(ref_student, teacher, weights=weights)
    want.loss.backward()
    student.requires_grad_()
    got = opd_loss(student, teacher, weights=weights, backend="triton")
    got.loss.backward()

    for name in ("loss", "loss_sum", "weight_sum", "ce_sum", "rkl_sum"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), **fwd_tol)
    assert int(got.clipped_entries) == int(want.clipped_entries)
    assert int(got.clipped_rows) == int(want.clipped_rows)
    assert got.total_entries == want.total_entries == 4 * 300
    torch.testing.assert_close(student.grad, ref_student.grad, **grad_tol)


@pytest.mark.parametrize("with_grad", [True, False])
@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_every_output_element_is_written(dtype_name, with_grad):
    """NaN / sentinel pre-filled buffers come back fully overwritten and correct."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    n, v = 7, 300
    # Row stride 320 != V: the kernel must use the stride, not V, between rows.
    padded_s, padded_t = _logits(n, v + 20, dtype, seed=4)
    student, teacher = padded_s[:, 10 : 10 + v], padded_t[:, 10 : 10 + v]
    nan = dict(device=DEVICE, dtype=torch.float32)
    out = OPDRows(
        loss=torch.full((n,), float("nan"), **nan),
        ce=torch.full((n,), float("nan"), **nan),
        rkl=torch.full((n,), float("nan"), **nan),
        clipped=torch.full((n,), -1, device=DEVICE, dtype=torch.int64),
    )
    grad = torch.full((n, v), float("nan"), device=DEVICE, dtype=dtype)
    launch_opd_loss_kernel(
        student_logits=student,
        teacher_logits=teacher,
        loss=out.loss,
        ce=out.ce,
        rkl=out.rkl,
        clipped=out.clipped,
        grad=grad if with_grad else None,
        alpha=0.8,
        delta=0.01,
        block_size=BLOCK,
    )
    want, want_grad = _reference(student, teacher, None, alpha=0.8, delta=0.01)
    _assert_rows_close(out, want, fwd_tol)
    if with_grad:
        assert not grad.isnan().any(), grad.isnan().nonzero()
        torch.testing.assert_close(grad, want_grad, **grad_tol)
    else:
        assert grad.isnan().all(), "no gradient requested, yet the buffer was touched"


@pytest.mark.parametrize("alpha", _ALPHAS)
def test_zero_weight_rows_are_ignored(alpha):
    """Rows with weight 0 add nothing to any statistic and get an exactly zero grad."""
    student, teacher = _logits(6, 200, torch.float32, seed=5)
    weights = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0], device=DEVICE)
    ref_student = student.clone().requires_grad_()
    want = opd_loss_reference(ref_student, teacher, alpha=alpha, weights=weights)
    want.loss.backward()
    student.requires_grad_()
    got = opd_loss(student, teacher, alpha=alpha, weights=weights, backend="triton")
    got.loss.backward()

    assert got.total_entries == 3 * 200
    assert int(got.clipped_entries) == int(want.clipped_entries)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.rkl_sum, want.rkl_sum, atol=1e-5, rtol=1e-5)
    assert torch.equal(student.grad[weights == 0], torch.zeros_like(student.grad[:3]))
    torch.testing.assert_close(student.grad, ref_student.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("alpha", _ALPHAS)
def test_fully_clipped_rows_keep_only_the_ce_gradient(alpha):
    """When every f_v > delta, RKL is the constant V * delta and adds no gradient."""
    n, v, delta = 3, 300, 1e-9
    student, _ = _logits(n, v, torch.float32, seed=6)
    # log(q_v / p_v) = -/+ 2 - c alternates sign and is never 0, so q_v != p_v
    # everywhere; f_v = p_v (g e^g - e^g + 1) is above 1e-7 here, far above delta.
    sign = torch.ones(v, device=DEVICE)
    sign[1::2] = -1.0
    teacher = student + 2.0 * sign
    want, want_grad = _reference(student, teacher, None, alpha=alpha, delta=delta)
    got, got_grad = _kernel(student, teacher, None, alpha=alpha, delta=delta)

    assert got.clipped.tolist() == [v] * n, got.clipped
    torch.testing.assert_close(got.rkl, torch.full_like(got.rkl, v * delta))
    _assert_rows_close(got, want, dict(atol=1e-5, rtol=1e-5))
    ce_grad = torch.softmax(student, -1)
    ce_grad[torch.arange(n), teacher.argmax(-1)] -= 1.0
    torch.testing.assert_close(got_grad, alpha * ce_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)
    if alpha == 0.0:
        assert torch.equal(got_grad, torch.zeros_like(got_grad))


@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_infinite_delta_is_plain_reverse_kl(dtype_name):
    """delta = inf clips nothing: rkl = KL(q || p) and its gradient is KL's."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    student, teacher = _logits(7, 300, dtype, seed=7)
    student_kl = student.float().requires_grad_()
    log_q = torch.log_softmax(student_kl, -1)
    log_p = torch.log_softmax(teacher.float(), -1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    kl.sum().backward()
    got, got_grad = _kernel(student, teacher, None, alpha=0.0, delta=float("inf"))

    assert got.clipped.tolist() == [0] * 7
    torch.testing.assert_close(got.rkl, kl.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, student_kl.grad.to(dtype), **grad_tol)


@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_identical_student_and_teacher_give_zero_rkl(dtype_name):
    """q == p: every f_v is 0, nothing is clipped and the RKL gradient vanishes."""
    dtype, _, _ = _DTYPES[dtype_name]
    student, _ = _logits(5, 300, dtype, seed=8)
    got, got_grad = _kernel(student, student.clone(), None, alpha=0.0, delta=0.01)
    assert got.clipped.tolist() == [0] * 5
    assert got.rkl.abs().max() < 1e-6, got.rkl
    assert got_grad.float().abs().max() < 1e-6, got_grad.abs().max()


def test_teacher_argmax_ties_take_the_first_index():
    """y = argmax p breaks ties like torch.argmax, within and across chunks."""
    v = 300
    teacher = torch.zeros(4, v)
    teacher[0, [70, 10, 200]] = 5.0  # tie across chunks 0, 1, 3 -> 10
    teacher[1, [40, 33, 299]] = 5.0  # tie inside chunk 0 and the tail -> 33
    teacher[2, [299, 260]] = 5.0  # tie inside the masked tail chunk -> 260
    # row 3: all equal -> 0
    teacher = teacher.to(DEVICE)
    student, _ = _logits(4, v, torch.float32, seed=9)
    want, want_grad = _reference(student, teacher, None, alpha=1.0, delta=0.01)
    got, got_grad = _kernel(student, teacher, None, alpha=1.0, delta=0.01)

    assert teacher.argmax(-1).tolist() == [10, 33, 260, 0]
    torch.testing.assert_close(got.ce, want.ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_zero_probability_teacher_entries_are_floored(dtype_name):
    """-inf teacher logits (masked tokens) give finite, clipped entries."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    student, teacher = _logits(3, 300, dtype, seed=10)
    teacher[:, ::7] = float("-inf")
    want, want_grad = _reference(student, teacher, None, alpha=0.8, delta=0.01)
    got, got_grad = _kernel(student, teacher, None, alpha=0.8, delta=0.01)
    assert torch.isfinite(got.loss).all() and torch.isfinite(got_grad).all()
    _assert_rows_close(got, want, fwd_tol)
    torch.testing.assert_close(got_grad, want_grad, **grad_tol)


def test_default_block_size_matches_reference():
    """The launch defaults (one power-of-two block covering V) agree too."""
    student, teacher = _logits(3, 300, torch.float32, seed=11)
    want, want_grad = _reference(student, teacher, None, alpha=0.8, delta=0.01)
    got, got_grad = _kernel(
        student, teacher, None, alpha=0.8, delta=0.01, block_size=None
    )
    _assert_rows_close(got, want, dict(atol=1e-5, rtol=1e-5))
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-4)


def test_without_grad_only_forward_runs():
    """A student without requires_grad gets the forward terms and no graph."""
    student, teacher = _logits(3, 100, torch.float32, seed=12)
    got = opd_loss_rows_triton(student, teacher, alpha=0.8, delta=0.01)
    want = opd_loss_rows_reference(student, teacher, alpha=0.8, delta=0.01)
    assert not got.loss.requires_grad
    _assert_rows_close(got, want, dict(atol=1e-5, rtol=1e-5))


def test_second_backward_raises():
    """The stored gradient is rescaled in place, so a second backward must fail."""
    student, teacher = _logits(2, 100, torch.float32, seed=13)
    student.requires_grad_()
    rows = opd_loss_rows_triton(student, teacher, alpha=0.8, delta=0.01)
    rows.loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        rows.loss.sum().backward()


def test_backend_dispatch():
    """auto picks Triton only for CUDA tensors; unknown backends are rejected."""
    student, teacher = _logits(3, 100, torch.float32, seed=14)
    want = opd_loss_rows_reference(student, teacher, alpha=0.8, delta=0.01)
    if DEVICE == "cpu":  # auto -> the torch reference itself, bit for bit
        auto = opd_loss_rows(student, teacher, alpha=0.8, delta=0.01)
        assert torch.equal(auto.loss, want.loss) and torch.equal(auto.rkl, want.rkl)
    forced = opd_loss_rows(student, teacher, alpha=0.8, delta=0.01, backend="triton")
    _assert_rows_close(forced, want, dict(atol=1e-5, rtol=1e-5))
    with pytest.raises(ValueError, match="backend='cuda'"):
        opd_loss_rows(student, teacher, alpha=0.8, delta=0.01, backend="cuda")
    assert callable(kernels.opd_loss), "the kernel module shadowed the public opd_loss"


def test_package_imports_without_triton():
    """adaflash_vllm.kernels imports and falls back to torch when triton is absent."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from adaflash_vllm.kernels import opd_loss\n"
        "z = torch.randn(2, 16)\n"
        "assert torch.isfinite(opd_loss(z, z.flip(-1)).loss)\n"
        "try:\n"
        "    opd_loss(z, z, backend='triton')\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("use_mean", [True, False], ids=["loss", "loss_sum"])
@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_fused_linear_matches_reference_on_materialised_logits(dtype_name, use_mean):
    """hidden + lm_head in chunks equals the reference on hidden @ W.T, grads too."""
    dtype, fwd_tol, grad_tol = _DTYPES[dtype_name]
    n, h, v = 7, 16, 300
    gen = torch.Generator().manual_seed(15)
    hidden = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    lm_head = (torch.randn(v, h, generator=gen) * 0.5).to(DEVICE, dtype)
    teacher = (torch.randn(n, v, generator=gen) * 2).to(DEVICE, dtype)
    weights = _row_weights(n)
    results = {}
    for backend in ("torch", "triton"):
        hid, w = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
        out = fused_linear_opd_loss(
            hid, w, teacher, weights=weights, chunk_rows=3, backend=backend
        )
        # .loss has grad_output 1 / weight_sum; .loss_sum has exactly 1.
        (out.loss if use_mean else out.loss_sum).backward()
        results[backend] = out, hid.grad, w.grad
    (want, want_dh, want_dw), (got, got_dh, got_dw) = results.values()

    for name in ("loss", "loss_sum", "ce_sum", "rkl_sum"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), **fwd_tol)
    assert int(got.clipped_entries) == int(want.clipped_entries)
    assert got.total_entries == want.total_entries == 6 * v
    # The gradient matmuls add their own rounding (per chunk, fp32 accumulation).
    mm_tol = grad_tol if dtype == torch.float32 else dict(atol=2e-2, rtol=3e-2)
    torch.testing.assert_close(got_dh, want_dh, **mm_tol)
    torch.testing.assert_close(got_dw, want_dw, **mm_tol)
