"""Where does one engine's decode step spend more than another's? Per-step
difference of two cProfile dumps written by `profile_step.py --save`.

Run (seconds; after two profile_step.py runs, e.g. plain and adaflash:no_draft):
    taskset -c 0 python examples/profile_step.py --config plain --concurrency 32 \
        --requests 96 --staggered --save /tmp/plain.pstats
    taskset -c 0 python examples/profile_step.py --config adaflash:no_draft \
        --concurrency 32 --requests 96 --staggered --save /tmp/no_draft.pstats
    python examples/diff_profiles.py /tmp/plain.pstats /tmp/no_draft.pstats

Prints, per function, milliseconds per engine step (cumulative time, or own time
with `--own`) in the first and the second dump and their difference, largest
difference first. cProfile inflates Python-heavy code, so the Python parts are
upper bounds.
"""

from __future__ import annotations

import argparse
import pstats


def per_step_ms(path: str, own: bool) -> tuple[dict[str, tuple[float, float]], int]:
    """{function: (ms per step, calls per step)} and the number of engine steps."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    steps = next(
        (
            calls
            for (file, _, name), (_, calls, *_rest) in stats.items()
            if file.endswith("v1/engine/core.py") and name == "step"
        ),
        0,
    )
    if not steps:
        raise SystemExit(f"{path}: no engine steps (vllm/v1/engine/core.py:step)")
    out = {}
    for (file, line, name), (_, calls, own_s, cum_s, _) in stats.items():
        key = f"{file.split('site-packages/')[-1]}:{line}:{name}"
        out[key] = (1e3 * (own_s if own else cum_s) / steps, calls / steps)
    return out, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--own", action="store_true", help="own time, not cumulative")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    a, steps_a = per_step_ms(args.first, args.own)
    b, steps_b = per_step_ms(args.second, args.own)
    print(f"steps: {steps_a} / {steps_b}")
    print(f"{'diff':>7} {'first':>7} {'second':>7} {'calls':>6}  function (ms/step)")
    rows = []
    for name in a.keys() | b.keys():
        (ta, _), (tb, cb) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
        rows.append((tb - ta, ta, tb, cb, name))
    for diff, ta, tb, cb, name in sorted(rows, reverse=True)[: args.top]:
        print(f"{diff:7.3f} {ta:7.3f} {tb:7.3f} {cb:6.1f}  {name[-100:]}")


if __name__ == "__main__":
    main()
