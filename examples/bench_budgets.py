"""What does choosing the `cost_aware` budgets cost per drafting step? Times
`allocate_budgets` (survivals [B, K] -> k_i) at several batch sizes, with the cost
curve evaluated in one vectorised pass (`StepCostModel.many`, what the proposer
uses) and point by point (any callable curve), in the same run.

Run (a few seconds):
    taskset -c 1 python examples/bench_budgets.py

Prints one line per batch size and one JSON line. The curve is shaped like the
demo's profile on this CPU (ms vs verified tokens); K = 7, k_min = 0.
"""

from __future__ import annotations

import argparse
import json
import timeit

import torch
from adaflash_vllm.proposers.budget import allocate_budgets
from adaflash_vllm.proposers.cost_model import StepCostModel

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TIMES_MS = [12.0, 12.0, 13.0, 13.0, 13.0, 18.0, 25.0, 29.0, 45.0, 80.0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--number", type=int, default=100, help="calls per timing")
    args = p.parse_args()
    torch.manual_seed(0)
    model = StepCostModel(SIZES, TIMES_MS)
    per_point = lambda n: model(n)  # noqa: E731  (hides `many`)
    result = {}
    for b in (int(x) for x in args.batches.split(",")):
        s = torch.rand(b, args.k).sort(-1, descending=True).values
        row = {}
        for name, curve in (("vectorised", model), ("per_point", per_point)):
            allocate_budgets(s, curve, 0, 5.0)  # warm-up
            t = timeit.timeit(
                lambda s=s, curve=curve: allocate_budgets(s, curve, 0, 5.0),
                number=args.number,
            )
            row[f"{name}_ms"] = 1e3 * t / args.number
        same = (
            allocate_budgets(s, model, 0, 5.0)[0]
            == (allocate_budgets(s, per_point, 0, 5.0)[0])
        )
        row["same_budgets"] = same
        result[b] = row
        print(
            f"B = {b:3d}: vectorised {row['vectorised_ms']:.3f} ms, per point "
            f"{row['per_point_ms']:.3f} ms per allocation (same budgets: {same})"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
