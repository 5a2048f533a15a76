"""What the target's forward costs per token count, one count at a time: timed
`_dummy_run`s of the demo target in a plain in-process engine (what AdaFlash's
cost profile times at startup), interleaved passes over the counts, forward and
backward alternately; printed per count: the fastest and second fastest sample.

Run (about a minute):
    taskset -c 0 python examples/forward_cost.py --max-tokens 16 --passes 9
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--passes", type=int, default=9)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from adaflash_vllm.bench.paired import offline_engine

    llm = offline_engine(str(DEMO / "target"), None, 1)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    sizes = list(range(1, args.max_tokens + 1))
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for n in sizes:
        runner._dummy_run(n)  # warm-up
    for i in range(args.passes):
        for n in sizes if i % 2 == 0 else sizes[::-1]:
            t = time.perf_counter()
            runner._dummy_run(n)
            samples[n].append(1e3 * (time.perf_counter() - t))
    rows = {n: sorted(v)[:2] for n, v in samples.items()}
    for n, (fastest, second) in rows.items():
        print(f"{n:4d} tokens: {fastest:6.3f} ms fastest, {second:6.3f} ms second")
    print(json.dumps({"ms_fastest_second": rows, "passes": args.passes}))


if __name__ == "__main__":
    main()
