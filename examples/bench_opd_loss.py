"""Benchmark the fused Triton OPD loss against the torch reference on one CUDA GPU.

    python examples/bench_opd_loss.py                      # V=151936, N=256/2048/8192
    python examples/bench_opd_loss.py --rows 256 --repeats 5   # quick look

Each (dtype, N) runs forward + backward of `OPDLoss.loss` for both providers on the
same inputs: warm-up steps first (Triton compiles there), then `--repeats` timed
steps with torch.cuda.synchronize() before each clock read; peak memory is
torch.cuda.max_memory_allocated() after a reset, minus the inputs already resident.
Time budget: about 2 minutes on an H100/H200 (the reference dominates at N=8192);
`--max-seconds` skips what is left once it is spent. Progress goes to stderr; stdout
is a table, then one JSON object (ratios, git sha, versions, GPU) as its last line.

Shape symbols: N rows, V vocabulary.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from adaflash_vllm.training.losses import (
    OPDLoss,
    opd_loss_reference,
    reduce_opd_rows,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Step = Callable[[torch.Tensor, torch.Tensor], OPDLoss]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936, help="V (Qwen3 vocabulary)")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 2048, 8192], help="N")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--delta", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--block-size", type=int, default=None, help="Triton BLOCK_SIZE")
    p.add_argument("--max-seconds", type=float, default=270.0)
    args = p.parse_args()
    if args.repeats < 2:
        p.error(f"--repeats must be >= 2 for quantiles, got {args.repeats}")
    return args


def make_providers(args: argparse.Namespace) -> dict[str, Step]:
    """The two code paths `adaflash_vllm.kernels.opd_loss` dispatches between."""
    from adaflash_vllm.kernels.opd_loss import opd_loss_rows_triton

    def triton_step(student: torch.Tensor, teacher: torch.Tensor) -> OPDLoss:
        rows = opd_loss_rows_triton(
            student,
            teacher,
            alpha=args.alpha,
            delta=args.delta,
            block_size=args.block_size,
        )
        return reduce_opd_rows(rows, None, student.shape[-1])

    def torch_step(student: torch.Tensor, teacher: torch.Tensor) -> OPDLoss:
        return opd_loss_reference(student, teacher, alpha=args.alpha, delta=args.delta)

    return {"triton": triton_step, "torch": torch_step}


def run_step(step: Step, student: torch.Tensor, teacher: torch.Tensor) -> float:
    """One forward + backward; returns the loss value."""
    student.grad = None
    out = step(student, teacher)
    out.loss.backward()
    return out.loss.item()


def measure(
    step: Step, student: torch.Tensor, teacher: torch.Tensor, args: argparse.Namespace
) -> dict:
    """Peak extra memory (MiB) and step times (ms) of one provider, or its OOM."""
    try:
        for _ in range(args.warmup):
            loss = run_step(step, student, teacher)
        student.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        run_step(step, student, teacher)
        torch.cuda.synchronize()
        peak_mib = (torch.cuda.max_memory_allocated() - resident) / 2**20
        times_ms = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = run_step(step, student, teacher)
            torch.cuda.synchronize()
            times_ms.append((time.perf_counter() - start) * 1e3)
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        student.grad = None
        gc.collect()
        torch.cuda.empty_cache()
    q20, q50, q80 = (
        statistics.quantiles(times_ms, n=10, method="inclusive")[i] for i in (1, 4, 7)
    )
    return {
        "oom": False,
        "loss": loss,
        "peak_mib": peak_mib,
        "p20_ms": q20,
        "p50_ms": q50,
        "p80_ms": q80,
    }


def bench_case(
    dtype_name: str, rows: int, providers: dict[str, Step], args: argparse.Namespace
) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (rows, args.vocab)
    dtype = DTYPES[dtype_name]
    student = torch.randn(shape, generator=gen, device="cuda", dtype=dtype) * 2
    teacher = torch.randn(shape, generator=gen, device="cuda", dtype=dtype) * 2
    student.requires_grad_()
    case = {"dtype": dtype_name, "rows": rows, "vocab": args.vocab}
    for name, step in providers.items():
        case[name] = measure(step, student, teacher, args)
    del student, teacher
    gc.collect()
    torch.cuda.empty_cache()
    tri, ref = case["triton"], case["torch"]
    if not (tri["oom"] or ref["oom"]):
        case["speedup"] = ref["p50_ms"] / tri["p50_ms"]
        case["memory_ratio"] = ref["peak_mib"] / max(tri["peak_mib"], 1e-9)
        case["loss_abs_diff"] = abs(tri["loss"] - ref["loss"])
    return case


def format_table(cases: list[dict]) -> str:
    head = (
        f"{'dtype':>5} {'N':>6} | {'triton ms p50 (p20-p80)':>24} {'extra MiB':>9} | "
        f"{'torch ms p50 (p20-p80)':>24} {'extra MiB':>9} | {'speedup':>7} {'mem x':>7}"
    )
    lines = [head, "-" * len(head)]

    def cell(r: dict) -> str:
        if r.get("skipped"):
            return f"{'skipped':>24} {'':>9}"
        if r["oom"]:
            return f"{'OOM':>24} {'':>9}"
        spread = f"{r['p50_ms']:.2f} ({r['p20_ms']:.2f}-{r['p80_ms']:.2f})"
        return f"{spread:>24} {r['peak_mib']:>9.0f}"

    for c in cases:
        ratios = (
            f"{c['speedup']:>7.2f} {c['memory_ratio']:>7.1f}"
            if "speedup" in c
            else f"{'-':>7} {'-':>7}"
        )
        lines.append(
            f"{c['dtype']:>5} {c['rows']:>6} | {cell(c['triton'])} | "
            f"{cell(c['torch'])} | {ratios}"
        )
    return "\n".join(lines)


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench_opd_loss.py needs a CUDA GPU (torch.cuda.is_available() is "
            f"False, torch {torch.__version__}); nothing was measured."
        )
    try:
        import triton
    except ImportError:
        sys.exit("bench_opd_loss.py needs triton (pip install triton).")

    providers = make_providers(args)
    started = time.perf_counter()
    cases = []
    for dtype_name in args.dtypes:
        for rows in args.rows:
            if time.perf_counter() - started > args.max_seconds:
                skipped = {"skipped": True, "oom": False}
                cases.append(
                    {
                        "dtype": dtype_name,
                        "rows": rows,
                        "vocab": args.vocab,
                        "triton": skipped,
                        "torch": skipped,
                    }
                )
                continue
            cases.append(bench_case(dtype_name, rows, providers, args))
            print(
                f"[{time.perf_counter() - started:6.1f}s] {dtype_name} N={rows} done",
                file=sys.stderr,
                flush=True,
            )

    print(format_table(cases))
    summary = {
        "bench": "opd_loss",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(),
        "args": vars(args),
        "ratios": {
            f"{c['dtype']}_N{c['rows']}": {
                "speedup": c.get("speedup"),
                "memory_ratio": c.get("memory_ratio"),
            }
            for c in cases
        },
        "cases": cases,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
