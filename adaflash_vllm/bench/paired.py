"""Paired rounds: two (or more) offline engines in one process, served the same
batch in alternating order, so that a slow spell of a shared machine hits all of
them alike. Each round records tok/s and the engine's own CPU milliseconds per
output token (its engine-core and worker processes), which is far less noisy than
wall time on a VM whose other tenants steal cycles.

Used by `examples/compare_logging.py` and `examples/compare_no_draft.py`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    tok_s: float
    cpu_ms_per_token: float
    tokens: int


def child_pids() -> set[int]:
    """Processes this one started (recursively): an engine's core and workers."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def offline_engine(
    target: str, spec: dict | None, concurrency: int, *, log_stats: bool = False
):
    """The offline engine the paired comparisons serve (eager, float32, 1024
    tokens per sequence, `concurrency` requests at a time). `log_stats`: vLLM's
    per-step stats on, as `vllm serve` has them (LLM turns them off)."""
    from vllm import LLM

    return LLM(
        target,
        max_num_seqs=concurrency,
        enforce_eager=True,
        max_model_len=1024,
        dtype="float32",
        speculative_config=spec,
        disable_log_stats=not log_stats,
    )


def staggered_lengths(num: int, max_tokens: int, seed: int = 0) -> list[int]:
    """`num` output lengths drawn from [max_tokens / 3, 5 max_tokens / 3]
    (seeded): requests end at different steps and new ones start while others
    decode, as when served."""
    from adaflash_vllm.bench.workloads import seeded_lengths

    lo, hi = max(max_tokens // 3, 1), 5 * max_tokens // 3
    return seeded_lengths(num, lo, hi, seed)


def staggered_params(num: int, max_tokens: int, seed: int = 0) -> list:
    """`num` greedy SamplingParams (ignore_eos) with `staggered_lengths`."""
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in staggered_lengths(num, max_tokens, seed)
    ]


def start_engine(build: Callable[[], object]) -> tuple[object, set[int]]:
    """Build an engine and return it with the processes it started."""
    before = child_pids()
    engine = build()
    return engine, child_pids() - before


def cpu_seconds(pids: set[int]) -> float:
    """CPU seconds (user + system, all threads) of processes `pids`."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(psutil.Process(pid).cpu_times()[:2])
    return total


def serve_round(llm, pids: set[int], prompts: list[str], params) -> Round:
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Round(tokens / wall, 1e3 * cpu / tokens, tokens)


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% interval (normal approximation)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))


def round_order(names: list[str], i: int) -> list[str]:
    """The engines' order in round `i`: `names` rotated by one per round, so
    that each engine takes every place in turn (see `alternating_rounds`)."""
    shift = i % len(names)
    return names[shift:] + names[:shift]


def alternating_rounds(
    engines: dict[str, tuple[object, set[int]]],
    prompts: list[str],
    params,
    rounds: int,
    per_round: int,
    on_round: Callable[[int, dict[str, Round]], None] | None = None,
) -> dict[str, list[Round]]:
    """Serve `rounds` batches of `per_round` prompts (cycling through `prompts`)
    to every engine; the order of the engines rotates by one every round (with
    two engines: it reverses), so that each takes every place in turn. With
    three or more, reversing the order would run the end ones twice in a row
    at every round's turn and the middle ones never: in
    examples/follow_up_turns.py, whose order reversed, a plain engine at a
    round's first place (which had also run last in the round before) ran
    7-11% faster than its twin at the round's last place (BENCHMARKS.md run
    35). `params` is
    one SamplingParams or a list with one per prompt (cycled alike)."""
    rows: dict[str, list[Round]] = {name: [] for name in engines}
    for i in range(rounds):
        picks = [(i * per_round + j) % len(prompts) for j in range(per_round)]
        batch = [prompts[k] for k in picks]
        each = isinstance(params, list)
        batch_params = [params[k] for k in picks] if each else params
        for name in round_order(list(engines), i):
            llm, pids = engines[name]
            rows[name].append(serve_round(llm, pids, batch, batch_params))
        if on_round is not None:
            on_round(i, {name: r[-1] for name, r in rows.items()})
    return rows


def paired_ratios(rows: dict[str, list[Round]], num: str, den: str) -> dict[str, float]:
    """Per-round ratios num / den, as means with 95% half-widths and medians."""
    pairs = list(zip(rows[den], rows[num], strict=True))
    tok = [n.tok_s / d.tok_s for d, n in pairs]
    cpu = [n.cpu_ms_per_token / d.cpu_ms_per_token for d, n in pairs]
    tok_m, tok_h = mean_ci(tok)
    cpu_m, cpu_h = mean_ci(cpu)
    return {
        "rounds": len(pairs),
        "tok_s_ratio_mean": tok_m,
        "tok_s_ratio_ci95": tok_h,
        "tok_s_ratio_median": statistics.median(tok),
        "cpu_per_token_ratio_mean": cpu_m,
        "cpu_per_token_ratio_ci95": cpu_h,
    }
