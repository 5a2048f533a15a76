"""The draft gate's credited rounds from a trace (`examples/gate_trace/`): per
batch-size range, each mode's tokens per ms, its mean tokens and ms per round,
split by how long the mode had run when the round was decided (rounds 2-5 of a
run are explorations or the start of a switch, 6+ sustained; round 1 of a run
is not credited; `--positions 2,3,4,5,6-10,11+` splits them finer). Shows
whether short explorations measure a mode as sustained running of it does.

With `--windows`, instead: a stream served in closed windows (the demo's
`LLM.generate` of a window of requests at a time) split into its windows, each
window's steps and their time at its full batch and below it. Shows how long a
window drains once its requests finish apart.

Run: python examples/gate_rounds.py /tmp/gate   (reads /tmp/gate.<pid>)
     python examples/gate_rounds.py /tmp/gate --windows
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


def windows(path: str) -> list[dict]:
    """The trace's decisions split into closed windows: a window starts where
    the batch rises to its largest size in the trace. Per window: steps, and
    steps and ms (from one decision to the next) at that size, below it and at
    1-3 requests; steps drafted."""
    steps = []  # (time, num_reqs, drafted)
    with open(path) as f:
        for line in f:
            p = line.split()
            if p and p[0] == "S":
                steps.append((float(p[1]), int(p[2]), int(p[3])))
    if not steps:
        return []
    full = max(n for _, n, _ in steps)
    out, start = [], 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or (steps[i][1] == full and steps[i - 1][1] < full):
            w = steps[start:i]
            ms = [1e3 * (b[0] - a[0]) for a, b in zip(w, w[1:], strict=False)]
            out.append(
                {
                    "steps": len(w),
                    "drafted": sum(d for _, _, d in w),
                    "full_steps": sum(n == full for _, n, _ in w),
                    "full_ms": sum(
                        m for (_, n, _), m in zip(w, ms, strict=False) if n == full
                    ),
                    "below_steps": sum(n < full for _, n, _ in w),
                    "below_ms": sum(
                        m for (_, n, _), m in zip(w, ms, strict=False) if n < full
                    ),
                    "small_steps": sum(n <= 3 for _, n, _ in w),
                }
            )
            start = i
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
    p.add_argument(
        "--windows",
        action="store_true",
        help="split a stream of closed windows into its windows instead",
    )
    args = p.parse_args()
    if args.windows:
        for path in sorted(glob.glob(args.prefix + ".*")):
            print(path)
            for i, w in enumerate(windows(path)):
                print(
                    f"  window {i:3d}: {w['steps']:4d} steps ({w['drafted']} drafted); "
                    f"full batch {w['full_steps']:4d} steps {w['full_ms']:7.0f} ms; "
                    f"below it {w['below_steps']:4d} steps {w['below_ms']:7.0f} ms "
                    f"({w['small_steps']} at 1-3 requests)"
                )
        return
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
