"""Two configurations of one `adaflash bench shift` stream, window by window.

Every configuration of a shift stream serves the same prompts in the same order
(windows of `--window` requests), so a window's tau in one configuration pairs
with the same window's in another: the text is the same, only the drafter
versions differ. Per phase this prints both configurations' tau (weighted by
rounds) and the mean per-window ratio with its 95% interval, over the whole
phase and over its first `--head` windows (how a phase starts: what the drafter
kept of a domain the stream returns to).

Run (after `adaflash bench shift --configs online@...,replay1@... --out DIR`):
    python examples/shift_paired.py DIR --configs online,replay1
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from adaflash_vllm.bench.paired import mean_ci


def load_points(out_dir: Path, config: str) -> list[dict]:
    """The per-window points of one configuration's result JSON."""
    return json.loads((out_dir / f"{config}.json").read_text())["points"]


def phases(points: list[dict]) -> list[tuple[str, list[dict]]]:
    """The stream's phases in order, each a run of consecutive windows; a set
    served again later (`prose,...,prose`) is its own phase, "(again)"."""
    out: list[tuple[str, list[dict]]] = []
    seen: set[str] = set()
    for name, run in itertools.groupby(points, key=lambda q: q["phase"]):
        out.append((f"{name} (again)" if name in seen else name, list(run)))
        seen.add(name)
    return out


def weighted_tau(points: list[dict]) -> float:
    rounds = sum(p["rounds"] for p in points)
    return sum(p["tau"] * p["rounds"] for p in points) / max(rounds, 1)


def paired_ratio(base: list[dict], other: list[dict]) -> tuple[float, float]:
    """Mean of other/base per window and its 95% half-interval (normal)."""
    return mean_ci([q["tau"] / p["tau"] for p, q in zip(base, other, strict=True)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="the stream's --out folder")
    p.add_argument(
        "--configs", default="online,replay1", help="BASE,OTHER (config names)"
    )
    p.add_argument("--head", type=int, default=10, help="windows a phase starts with")
    args = p.parse_args()
    base_name, other_name = args.configs.split(",")
    base = load_points(args.out_dir, base_name)
    other = load_points(args.out_dir, other_name)
    if [q["key"] for q in base] != [q["key"] for q in other]:
        raise SystemExit("the two configurations did not serve the same windows")
    for (phase, a), (_, b) in zip(phases(base), phases(other), strict=True):
        parts = (("all", slice(None)), (f"first {args.head}", slice(args.head)))
        for label, part in parts:
            mean, half = paired_ratio(a[part], b[part])
            print(
                f"{phase:22s} {label:9s} windows {len(a[part]):3d}  tau {base_name} "
                f"{weighted_tau(a[part]):.2f} {other_name} {weighted_tau(b[part]):.2f}"
                f"  {other_name}/{base_name} per window {mean:.3f} +- {half:.3f}"
            )


if __name__ == "__main__":
    main()
