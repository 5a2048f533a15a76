"""The draft gate's credited rounds from a trace (`examples/gate_trace/`): per
batch-size range, each mode's tokens per ms, its mean tokens and ms per round,
split by how long the mode had run when the round was decided (rounds 2-5 of a
run are explorations or the start of a switch, 6+ sustained; round 1 of a run
is not credited; `--positions 2,3,4,5,6-10,11+` splits them finer). Shows
whether short explorations measure a mode as sustained running of it does.

Run: python examples/gate_rounds.py /tmp/gate   (reads /tmp/gate.<pid>)
"""

from __future__ import annotations

import argparse
import glob
import statistics


def rounds(path: str) -> list[tuple[int, int, float, float, int]]:
    """(num_reqs, drafted, tokens, ms, position of its decision in the mode's run)."""
    out, decision, mode, run = [], None, None, 0
    with open(path) as f:
        for line in f:
            p = line.split()
            if not p:
                continue
            if p[0] == "S":
                num_reqs, draft = int(p[2]), int(p[3])
                run = run + 1 if draft == mode else 1
                mode, decision = draft, (num_reqs, run)
            elif p[0] == "R" and decision is not None:
                drafted, tokens, ms = int(p[2]), float(p[3]), float(p[4])
                out.append((decision[0], drafted, tokens, ms, decision[1]))
    return out


def _position_span(text: str) -> tuple[str, int, int]:
    """ "4" -> ("4", 4, 4); "2-5" -> ("2-5", 2, 5); "6+" -> ("6+", 6, inf)."""
    if text.endswith("+"):
        return text, int(text[:-1]), 10**9
    lo, _, hi = text.partition("-")
    return text, int(lo), int(hi or lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix", help="ADAFLASH_GATE_TRACE's value")
    p.add_argument("--ranges", default="1-4,5-8,9-12,13-14,15-16,17-32,33-64")
    p.add_argument(
        "--positions",
        default="2-5,6+",
        help="how to split each mode's runs by round position: spans N, N-M or N+",
    )
    args = p.parse_args()
    positions = [_position_span(x) for x in args.positions.split(",") if x]
    for path in sorted(glob.glob(args.prefix + ".*")):
        got = rounds(path)
        if not got:
            continue
        print(f"{path}: {len(got)} credited rounds")
        for span in args.ranges.split(","):
            lo, hi = (int(x) for x in span.split("-"))
            for drafted in (1, 0):
                for name, first, last in positions:
                    sel = [
                        r
                        for r in got
                        if lo <= r[0] <= hi
                        and r[1] == drafted
                        and first <= r[4] <= last
                    ]
                    if not sel:
                        continue
                    tokens = statistics.fmean(r[2] for r in sel)
                    ms = statistics.fmean(r[3] for r in sel)
                    mode = "drafting" if drafted else "skipping"
                    print(
                        f"  {lo:3d}-{hi:<3d} {mode:8s} rounds {name:5s} "
                        f"n={len(sel):5d}  {tokens / ms:6.3f} tokens/ms "
                        f"({tokens:6.1f} tokens in {ms:6.1f} ms)"
                    )


if __name__ == "__main__":
    main()
