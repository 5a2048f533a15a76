"""How long does a drafter swap stall the engine's step? The demo models served
offline by one `LLM` with online distillation on (no trainer: this script
publishes the versions itself, each the demo drafter with its weights scaled by a
version-specific factor), while 8 requests at a time keep the engine stepping.

Run (about 2 minutes on 2 cores):
    taskset -c 0 python examples/measure_swap_stall.py --swaps 20

Prints each swap's stall (the time the step waited for the write, as the engine
reports it in `vllm:adaflash_swap_stall_ms`), then the median, p90 and max, and one
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


def _publish(versions: Path, version: int) -> None:
    from adaflash_vllm.training.checkpoint import load_drafter

    from adaflash_vllm.versions import publish_version

    cfg, state = load_drafter(DEMO / "drafter")
    scale = 1.0 + 0.001 * version  # a different (still good) drafter each time
    state = {k: v * scale for k, v in state.items()}
    publish_version(versions, version, cfg, state, {"measure_swap_stall": True})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--swaps", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per swap")
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
    prompts = [
        json.loads(line)["prompt"]
        for line in (DEMO / "data" / "prompts_prose.jsonl").read_text().splitlines()
    ][: args.concurrency]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    stop = threading.Event()

    def keep_serving() -> None:
        while not stop.is_set():
            llm.generate(prompts, params, use_tqdm=False)

    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    server = threading.Thread(target=keep_serving, daemon=True)
    server.start()
    stalls = []
    try:
        for version in range(1, args.swaps + 1):
            _publish(root / "versions", version)
            deadline = time.monotonic() + args.timeout_s
            while True:
                g = _gauges(llm)
                if g.get("vllm:adaflash_drafter_version") == version:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"version {version} never went live: {g}")
                time.sleep(0.05)
            stalls.append(g["vllm:adaflash_swap_stall_ms"])
            print(f"swap {version:3d}: step stalled {stalls[-1]:6.2f} ms", flush=True)
    finally:
        stop.set()
        server.join()
    q = statistics.quantiles(stalls, n=10) if len(stalls) > 1 else stalls
    summary = {
        "swaps": len(stalls),
        "stall_ms_median": statistics.median(stalls),
        "stall_ms_p90": q[-1],
        "stall_ms_max": max(stalls),
    }
    print(
        f"stall per swap: median {summary['stall_ms_median']:.2f} ms, "
        f"p90 {summary['stall_ms_p90']:.2f} ms, max {summary['stall_ms_max']:.2f} ms"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
