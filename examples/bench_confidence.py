"""What do the drafts' confidence features cost? Times `draft_confidence`
(log p_top1, top-1/top-2 margin, entropy per draft slot) on random logits of the
demo's vocabulary (4,096) for one request (7 slots) and 32 requests (224 slots),
on one thread, median of interleaved repeats.

Run (seconds):
    taskset -c 1 python examples/bench_confidence.py
"""

from __future__ import annotations

import statistics
import time

import torch
from adaflash_vllm.proposers.length_head import draft_confidence


def main() -> None:
    torch.set_num_threads(1)
    logits = {rows: torch.randn(rows, 4096) * 3 for rows in (7, 224)}
    times: dict[int, list[float]] = {rows: [] for rows in logits}
    for _ in range(100):
        for rows, x in logits.items():
            started = time.perf_counter()
            draft_confidence(x)
            times[rows].append(1e3 * (time.perf_counter() - started))
    for rows, samples in times.items():
        print(f"{rows:4d} slots x 4096: median {statistics.median(samples):.3f} ms")


if __name__ == "__main__":
    main()
