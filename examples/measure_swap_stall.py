"""How long does a drafter swap stall the engine's step? The demo models served
offline by one `LLM` with online distillation on (no trainer: this script
publishes the versions itself, each the demo drafter with its weights scaled by a
version-specific factor), while 8 requests at a time keep the engine stepping.

Run (about 2 minutes on 2 cores; `--staging` picks adaflash.online.swap_staging):
    taskset -c 0 python examples/measure_swap_stall.py --swaps 20 --staging slices

Prints each swap's stall (the time the step waited for the write, as the engine
reports it in `vllm:adaflash_swap_stall_ms`), then the median, p90 and max; the
worker's step intervals that overlap a swap's background fetch or its write
against the other steps (the time a swap adds to serving, stall or not); and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def _gauges(llm) -> dict[str, float]:
    return {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:adaflash_") and hasattr(m, "value")
    }


def _prepare(folder: Path, version: int) -> None:
    """Write version `version` into `folder` (before serving: writing it costs
    CPU that would otherwise land on the engine's core during the swap)."""
    from adaflash_vllm.training.checkpoint import load_drafter

    from adaflash_vllm.versions import publish_version

    cfg, state = load_drafter(DEMO / "drafter")
    scale = 1.0 + 0.001 * version  # a different (still good) drafter each time
    state = {k: v * scale for k, v in state.items()}
    publish_version(folder, version, cfg, state, {"measure_swap_stall": True})


def _publish(prepared: Path, versions: Path, version: int) -> None:
    """Publish a prepared version: move its folder in, then point LATEST at it."""
    from adaflash_vllm.versions import version_dirname

    versions.mkdir(parents=True, exist_ok=True)
    name = version_dirname(version)
    os.replace(prepared / name, versions / name)
    tmp = versions / ".LATEST.tmp"
    tmp.write_text(str(version))
    os.replace(tmp, versions / "LATEST")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--swaps", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per swap")
    p.add_argument("--gap-s", type=float, default=1.0, help="serving between swaps")
    p.add_argument(
        "--staging",
        choices=["slices", "thread", "one_step"],
        default="slices",
        help="adaflash.online.swap_staging",
    )
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="adaflash-swap-"))
    spec = {
        "method": "dflash",
        "model": str(DEMO / "drafter"),
        "num_speculative_tokens": 7,
        "adaflash": {
            "length": {"mode": "fixed"},
            "online": {
                "enabled": True,
                "push": False,
                "buffer_dir": str(root / "buffer"),
                "versions_dir": str(root / "versions"),
                "poll_interval_s": 0.05,
                "gate_window": 0,
                "swap_staging": args.staging,
            },
        },
    }
    llm = LLM(
        str(DEMO / "target"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=args.concurrency,
        speculative_config=spec,
        disable_log_stats=False,
    )
    # 8 times the engine's batch per generate(): the engine stays busy (finished
    # requests are replaced at once), idle only between two generate() calls.
    prompts = [
        json.loads(line)["prompt"]
        for line in (DEMO / "data" / "prompts_prose.jsonl").read_text().splitlines()
    ][: 8 * args.concurrency]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    stop = threading.Event()

    def keep_serving() -> None:
        while not stop.is_set():
            llm.generate(prompts, params, use_tqdm=False)

    for version in range(1, args.swaps + 1):
        _prepare(root / "prepared", version)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    llm.collective_rpc("adaflash_timeline", args=(True,))
    server = threading.Thread(target=keep_serving, daemon=True)
    server.start()
    stalls = []
    try:
        for version in range(1, args.swaps + 1):
            _publish(root / "prepared", root / "versions", version)
            deadline = time.monotonic() + args.timeout_s
            while True:
                g = _gauges(llm)
                if g.get("vllm:adaflash_drafter_version") == version:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"version {version} never went live: {g}")
                time.sleep(0.2)
            stalls.append(g["vllm:adaflash_swap_stall_ms"])
            print(f"swap {version:3d}: step stalled {stalls[-1]:6.2f} ms", flush=True)
            time.sleep(args.gap_s)  # steps without a swap in between
    finally:
        stop.set()
        server.join()
    timeline = llm.collective_rpc("adaflash_timeline", args=(False,))[0]
    q = statistics.quantiles(stalls, n=10) if len(stalls) > 1 else stalls
    summary = {
        "staging": args.staging,
        "swaps": len(stalls),
        "stall_ms_median": statistics.median(stalls),
        "stall_ms_p90": q[-1],
        "stall_ms_max": max(stalls),
        **step_delays(timeline),
    }
    print(
        f"stall per swap: median {summary['stall_ms_median']:.2f} ms, "
        f"p90 {summary['stall_ms_p90']:.2f} ms, max {summary['stall_ms_max']:.2f} ms"
    )
    print(
        f"steps overlapping a swap's fetch or write: {summary['swap_steps']} "
        f"(median {summary['swap_step_ms_median']:.1f} ms, max "
        f"{summary['swap_step_ms_max']:.1f} ms); other steps: median "
        f"{summary['other_step_ms_median']:.1f} ms, p99 "
        f"{summary['other_step_ms_p99']:.1f} ms; step time added per swap "
        f"{summary['added_ms_per_swap']:.1f} +- "
        f"{summary['added_ms_per_swap_ci95']:.1f} ms (95%), its slowest step "
        f"{summary['worst_step_excess_ms_median']:.1f} ms over the mean (median; "
        f"p90 {summary['worst_step_excess_ms_p90']:.1f} ms); CPU of the background "
        "fetch "
        f"(median) {summary['fetch_cpu_ms_median']:.1f} ms; checks and staging "
        f"between steps {summary['stage_ms_per_swap']:.1f} ms over "
        f"{summary['stage_steps_per_swap']:.1f} steps per swap"
    )
    print(json.dumps(summary))


def step_delays(timeline: list) -> dict:
    """Step intervals (propose start to propose start) that overlap a swap's
    events (its background fetch, staging slices, write) against the others.
    Each swap's added time is its overlapping steps' total excess over the
    other steps' mean; reported as the mean over swaps with a 95% interval."""
    starts = sorted(t0 for kind, t0, *_ in timeline if kind == "propose")
    events, n = [], -1
    for kind, t0, t1, _ in sorted(timeline, key=lambda e: e[1]):
        if kind == "propose":
            continue
        if kind == "fetch" or n < 0:
            n += 1  # each swap begins with its fetch
        events.append((t0, t1, n))
    steps = [
        (1e3 * (b - a), {k for t0, t1, k in events if t0 < b and a < t1})
        for a, b in zip(starts, starts[1:], strict=False)
    ]
    if not steps or n < 0:
        return {}
    # An interval over 5x the median spans an idle engine (between two
    # generate() calls): not a step, whichever side it falls on.
    cap = 5 * statistics.median(ms for ms, _ in steps)
    steps = [(ms, k) for ms, k in steps if ms < cap]
    other = [ms for ms, k in steps if not k]
    touched = [ms for ms, k in steps if k]
    base = statistics.fmean(other)
    added, worst = [0.0] * (n + 1), [0.0] * (n + 1)
    for ms, k in steps:
        for swap in k:
            added[swap] += (ms - base) / len(k)
            worst[swap] = max(worst[swap], ms - base)
    half = 1.96 * statistics.stdev(added) / len(added) ** 0.5 if n else float("nan")
    fetch_cpu = [1e3 * cpu for kind, *_, cpu in timeline if kind == "fetch"]
    staged = [(t1 - t0) for kind, t0, t1, _ in timeline if kind == "stage"]
    return {
        "swap_steps": len(touched),
        "swap_step_ms_median": statistics.median(touched) if touched else None,
        "swap_step_ms_max": max(touched) if touched else None,
        "other_steps": len(other),
        "other_step_ms_mean": base,
        "other_step_ms_median": statistics.median(other),
        "other_step_ms_p99": statistics.quantiles(other, n=100)[-1],
        "added_ms_per_swap": statistics.fmean(added),
        "added_ms_per_swap_ci95": half,
        # what a swap does to the p99: its slowest step's excess over the mean
        "worst_step_excess_ms_median": statistics.median(worst),
        "worst_step_excess_ms_p90": statistics.quantiles(worst, n=10)[-1]
        if n
        else worst[0],
        "fetch_cpu_ms_median": statistics.median(fetch_cpu) if fetch_cpu else None,
        "stage_ms_per_swap": 1e3 * sum(staged) / len(added),
        "stage_steps_per_swap": len(staged) / len(added),
    }


if __name__ == "__main__":
    main()
