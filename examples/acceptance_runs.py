"""Does acceptance run in stretches? Greedy verification rounds along served
chains of the demo drafter, offline: per-position survival after a round that
accepted a given number of drafts, and what the previous round's accepted count
alone predicts of the next, and the previous two rounds' (MAE of the median
forecast per group, as docs/BENCHMARKS.md scores the length head; in-sample and
two-fold across answers, which a forecast with more groups needs).

The target answers the prompts (vLLM, greedy); the training-side drafter (exact
vLLM parity, tests/engine/test_parity.py) drafts from every position; the rounds
are walked as greedy verification makes them, from the first generated token:
a round at position p accepts a(p) drafts, and the next starts at p + a(p) + 1.

Run (about 2 minutes on 2 cores):
    python examples/acceptance_runs.py --skip 100 --num-prompts 96
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"

# groups of the previous round's accepted count (K = 7)
_GROUPS = (("0", 0, 0), ("1", 1, 1), ("2-4", 2, 4), ("5-6", 5, 6), ("7", 7, 7))


def chain_rounds(by_anchor: dict[int, int], start: int, end: int, k: int):
    """The accepted count of each round along one chain of rounds whose block
    fits before the sequence's end (`served_chains`), in order."""
    from adaflash_vllm.training.head import served_chains

    accepted = [by_anchor.get(p, 0) for p in range(start, end - k)]
    return [accepted[i] for i, _, _ in served_chains(accepted, k)]


def chain_pairs(by_anchor: dict[int, int], start: int, end: int, k: int):
    """(previous round's accepted, this round's accepted) along one chain."""
    return round_pairs(chain_rounds(by_anchor, start, end, k))


def round_pairs(rounds: list[int]) -> list[tuple[int, int]]:
    """(previous round's accepted, this round's accepted) of a chain's rounds."""
    return list(zip(rounds, rounds[1:], strict=False))


def group(accepted: int | None) -> str | None:
    """The `_GROUPS` name of a previous round's accepted count (None: none)."""
    if accepted is None:
        return None
    return next(name for name, lo, hi in _GROUPS if lo <= accepted <= hi)


def history_rows(chains: list[list[int]]) -> list[tuple[int, str, str | None]]:
    """(accepted, the previous round's group, the one before's or None) of every
    round of `chains` that has a previous round."""
    return [
        (a, group(rounds[i - 1]), group(rounds[i - 2]) if i >= 2 else None)
        for rounds in chains
        for i, a in enumerate(rounds)
        if i >= 1
    ]


def grouped_median_mae(train, test, key, k: int) -> float:
    """MAE (as a share of K) on `test` rows of the median forecast per `key`
    cell fitted on `train` rows (rows: accepted first; a cell `train` lacks
    takes `train`'s overall median)."""
    cells: dict = {}
    for row in train:
        cells.setdefault(key(row), []).append(row[0])
    medians = {c: median_length(xs, k) for c, xs in cells.items()}
    overall = median_length([row[0] for row in train], k)
    return sum(abs(row[0] - medians.get(key(row), overall)) for row in test) / (
        len(test) * k
    )


_FORECASTS = {  # a forecast's cell key over history_rows' rows
    "constant": lambda row: None,
    "previous_round": lambda row: row[1],
    "previous_two_rounds": lambda row: row[1:],
}


def history_forecasts(chains: list[list[int]], k: int) -> dict:
    """MAE of each `_FORECASTS` median forecast on every round with a previous
    round: in-sample, and two-fold (chains alternately in each half, each half
    scored by the other's medians, the halves' mean)."""
    rows = history_rows(chains)
    halves = [history_rows(chains[0::2]), history_rows(chains[1::2])]
    out = {}
    for name, key in _FORECASTS.items():
        out[name] = {
            "in_sample": grouped_median_mae(rows, rows, key, k),
            "two_fold": sum(
                grouped_median_mae(halves[1 - h], halves[h], key, k) for h in (0, 1)
            )
            / 2,
        }
    return out


def median_length(xs: list[int], k: int) -> int:
    """The largest m with P(A >= m) >= 1/2."""
    return max(m for m in range(k + 1) if 2 * sum(x >= m for x in xs) >= len(xs))


def report(pairs: list[tuple[int, int]], k: int) -> dict:
    out = {"rounds": len(pairs), "survival_after": {}}
    for name, lo, hi in (("any", 0, k), *_GROUPS):
        xs = [a for pa, a in pairs if lo <= pa <= hi]
        out["survival_after"][name] = {
            "rounds": len(xs),
            "S": [
                round(sum(a >= j for a in xs) / max(1, len(xs)), 3)
                for j in range(1, k + 1)
            ],
        }
    rows = [(a, group(pa)) for pa, a in pairs]  # as history_rows, one round back
    for name in ("constant", "previous_round"):  # in-sample
        out[f"mae_{name}_median"] = grouped_median_mae(rows, rows, _FORECASTS[name], k)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default=str(DEMO / "data" / "prompts_prose.jsonl"))
    p.add_argument("--skip", type=int, default=100, help="prompts left out first")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()

    from adaflash_vllm.training.data import load_prompts
    from adaflash_vllm.training.features import TargetModel
    from adaflash_vllm.training.offline import anchor_acceptance, load_or_init_drafter
    from adaflash_vllm.training.train_drafter import regenerate_sequences

    recs = load_prompts(args.prompts)[args.skip : args.skip + args.num_prompts]
    seqs = regenerate_sequences(
        DEMO / "target", recs, max_tokens=args.max_tokens, temperature=0.0, seed=0
    )
    target = TargetModel(str(DEMO / "target"))
    drafter = load_or_init_drafter(str(DEMO / "drafter"), None)
    k = drafter.block_size - 1
    chains = [
        chain_rounds(by_anchor, s.prompt_len, len(s.token_ids) - 1, k)
        for s, by_anchor in anchor_acceptance(drafter, target, seqs, k)
    ]
    pairs = [pair for rounds in chains for pair in round_pairs(rounds)]
    result = report(pairs, k)
    result["median_forecasts"] = history_forecasts(chains, k)
    result["command"] = vars(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
