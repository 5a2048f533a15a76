"""What do the drafts' confidence features and greedy argmax cost? Times
`draft_confidence` (log p_top1, top-1/top-2 margin, entropy per draft slot)
against the features' term-by-term definition (logsumexp, topk and softmax over
each whole row, as AdaFlash computed them before 2026-12-02), and the drafts'
argmax (`row_max.first_argmax` against `argmax`), on random logits of the demo's
vocabulary (4,096) for one request (7 slots) and 32 requests (224 slots), on one
thread, median of 100 interleaved repeats per size.

Run (seconds):
    taskset -c 1 python examples/bench_confidence.py
"""

from __future__ import annotations

import statistics
import time

import torch
from adaflash_vllm.proposers.length_head import draft_confidence
from adaflash_vllm.proposers.row_max import first_argmax


def term_by_term(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    top2 = x.topk(2, dim=-1).values
    entropy = lse - (torch.softmax(x, dim=-1) * x).nan_to_num(0.0).sum(-1)
    return torch.stack(
        [(top2[:, 0] - lse).clamp_min(-30.0), (top2[:, 0] - top2[:, 1]), entropy], -1
    )


def main() -> None:
    torch.set_num_threads(1)
    logits = {rows: torch.randn(rows, 4096) * 3 for rows in (7, 224)}
    ways = {
        "draft_confidence": draft_confidence,
        "term_by_term": term_by_term,
        "first_argmax": first_argmax,
        "argmax": lambda x: x.argmax(-1),
    }
    times = {(rows, way): [] for rows in logits for way in ways}
    for rows, x in logits.items():
        for _ in range(100):
            for way, features in ways.items():
                started = time.perf_counter()
                features(x)
                times[rows, way].append(1e3 * (time.perf_counter() - started))
    for rows in logits:
        ours, naive, fast, plain = (statistics.median(times[rows, w]) for w in ways)
        print(
            f"{rows:4d} slots x 4096: draft_confidence {ours:.3f} ms, "
            f"term by term {naive:.3f} ms ({naive / ours:.2f}x); "
            f"first_argmax {fast:.3f} ms, argmax {plain:.3f} ms ({plain / fast:.2f}x)"
        )


if __name__ == "__main__":
    main()
