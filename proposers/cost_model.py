"""What a decode step costs as a function of the tokens the target verifies.

Profiled once in the worker (timed dummy forwards at a ladder of token counts,
before the first real step) and refreshed online from real decode steps: the
proposer times consecutive steps whose batch did not change. The cost-aware budget
policy only needs differences in cost between token counts, plus the step's fixed
part, both of which this gives.

A step's time is the curve at its token count plus a level shared by every count.
Each observation moves the level fast (EMA `ema`) and the curve's two points around
its token count slowly (`shape_ema`), decaying those two points toward the profile
(`shape_decay`: the level and a common shift of the points steps hit explain the
same steps, and unpulled that shift would drift with the noise). Points decay only
when a step lands next to them: a slope seen on rare steps (drafting steps under
load, where most steps skip drafting) then stays between them. A real step also
pays scheduling and output handling that the profile's dummy forwards do not, and
this VM's speed swings by tens of percent within a minute: both are the same at
every token count, so they go into the level. Moving single points by them instead
(as this did before) left points that steps never hit at their profiled value, and
made fake slopes out of noise between points that they do: at one request, cost(1) =
9 ms profiled against 16 ms observed at 2-8 tokens, and budgets trimmed drafts whose
slots were free.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable

import numpy as np


class StepCostModel:
    """Piecewise-linear step time (ms) over verified tokens n, refreshed online."""

    def __init__(
        self,
        sizes: list[int],
        times_ms: list[float],
        *,
        ema: float = 0.3,
        shape_ema: float = 0.02,
        shape_decay: float = 0.002,
        max_step_ratio: float = 2.0,
    ):
        if (
            len(sizes) < 2
            or sorted(sizes) != list(sizes)
            or len(sizes) != len(times_ms)
        ):
            raise ValueError(f"need >= 2 increasing sizes with times, got {sizes}")
        if any(t <= 0 for t in times_ms):
            raise ValueError(f"step times must be positive, got {times_ms}")
        self.sizes = list(sizes)
        self._profile = [float(t) for t in times_ms]
        self._shape = list(self._profile)  # what observations move
        self.times_ms = list(self._shape)  # its running max: the curve's shape
        self.level_ms = 0.0  # added at every token count
        self.ema, self.shape_ema, self.shape_decay = ema, shape_ema, shape_decay
        # One observation counts as at most this many times (or 1/this) the curve:
        # a hiccup (a GC pause, the OS) must not lift a point the budgets then avoid
        # and never measure again; a real change still converges, step by step.
        self.max_step_ratio = max_step_ratio
        self.observations = 0

    def _bracket(self, n: float) -> tuple[int, float]:
        """(i, w): n lies between sizes[i - 1] and sizes[i], with weight w on i."""
        s = self.sizes
        i = min(max(bisect.bisect_left(s, n), 1), len(s) - 1)
        return i, (n - s[i - 1]) / (s[i] - s[i - 1])

    def __call__(self, n: float) -> float:
        i, w = self._bracket(n)
        t = self.times_ms
        return max(1e-6, t[i - 1] + (t[i] - t[i - 1]) * w + self.level_ms)

    def many(self, n: np.ndarray) -> np.ndarray:
        """cost(n) for every element of n: the same curve in one vectorised pass
        (budgets evaluate it at every candidate slot count, B * K + 1 points)."""
        s = np.asarray(self.sizes, dtype=np.float64)
        t = np.asarray(self.times_ms, dtype=np.float64)
        x = np.asarray(n, dtype=np.float64)
        i = np.clip(np.searchsorted(s, x), 1, len(s) - 1)  # bisect_left, as _bracket
        w = (x - s[i - 1]) / (s[i] - s[i - 1])
        return np.maximum(t[i - 1] + (t[i] - t[i - 1]) * w + self.level_ms, 1e-6)

    def observe(self, n: int, ms: float) -> None:
        """Move the curve toward a measured step (n tokens, ms): the level by `ema`
        of the difference, the two table points around n by `shape_ema` of it,
        each by its interpolation weight (clamped outside the table). The step's
        ratio to the curve is bounded by `max_step_ratio`."""
        if ms <= 0 or n <= 0:
            return
        i, w = self._bracket(n)
        bound = self.max_step_ratio
        predicted = self(n)
        ratio = min(bound, max(1.0 / bound, ms / predicted))
        diff = predicted * (ratio - 1.0)
        self.level_ms += self.ema * diff
        # The two points decay toward the profile as the step moves them: the
        # level and a shift of all the points that steps hit explain the same
        # steps, and without a pull that shift (against the counts steps never
        # hit) would drift as noise. Only the points a step lands next to: a
        # decay of every point on every step pulled the counts that steps hit
        # rarely (drafting steps under load, when most steps skip drafting)
        # back to the profile between their steps: with one step in twenty
        # there, the curve kept half of the slope beyond the profile's
        # (BENCHMARKS.md run 31).
        decay = self.shape_decay
        for j, weight in ((i - 1, 1.0 - w), (i, w)):
            weight = min(1.0, max(0.0, weight))
            t = self._shape[j]
            t -= decay * weight * (t - self._profile[j])
            self._shape[j] = max(t + self.shape_ema * weight * diff, 1e-3)
        # More tokens never cost less. The running max is taken, not written back:
        # written back, every dip of a point below its left neighbour was undone
        # while every rise stayed, and noise alone ratcheted the curve up.
        self.times_ms = list(itertools.accumulate(self._shape, max))
        self.observations += 1

    @property
    def slope_ms_per_token(self) -> float:
        return (self.times_ms[-1] - self.times_ms[0]) / (self.sizes[-1] - self.sizes[0])

    def to_dict(self) -> dict:
        return {
            "sizes": self.sizes,
            "times_ms": self.times_ms,
            "profile_ms": self._profile,
            "level_ms": self.level_ms,
            "observations": self.observations,
        }


def profile_step_costs(
    run: Callable[[int], object],
    sizes: list[int],
    *,
    passes: int = 5,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCostModel:
    """Time `run(n)` (a dummy forward of n tokens) at every size.

    After one warm-up pass, `passes` timed passes visit every size in turn,
    forward and backward alternately, and the cost at n is its fastest sample.
    Contention only ever adds time, and a slow spell of the machine then lands on
    every size of a pass instead of on the sizes timed during it: taken size by
    size (median of 3), one spell that ended midway made a step in the curve, 3.4
    ms between 4 and 8 tokens at one request, whose real steps cost the same
    there (BENCHMARKS run 15).

    A rise between neighbouring sizes that is within the noise (the larger of the
    two sizes' gaps between their fastest and next fastest samples) is taken as
    flat. Errors toward flat correct themselves online: budgets then verify those
    counts and their steps lift the curve. Errors toward steep do not: budgets
    avoid the counts, whose points are never measured again."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for n in sizes:
        run(n)  # warm-up
    for p in range(passes):
        for n in sizes if p % 2 == 0 else reversed(sizes):
            if sync:
                sync()
            t0 = clock()
            run(n)
            if sync:
                sync()
            samples[n].append(1e3 * (clock() - t0))
    ranked = [sorted(samples[n]) for n in sizes]
    fastest = [r[0] for r in ranked]
    # The fastest sample's uncertainty: how far the next fastest is from it.
    spread = [r[1] - r[0] if len(r) > 1 else 0.0 for r in ranked]
    times = [fastest[0]]
    for j in range(1, len(sizes)):
        noise = max(spread[j], spread[j - 1])
        times.append(times[-1] if fastest[j] - times[-1] <= noise else fastest[j])
    return StepCostModel(sizes, times)


def profile_sizes(max_tokens: int, every_up_to: int = 1) -> list[int]:
    """Every count 1, 2, ..., `every_up_to`, then doubling (2x `every_up_to`, ...)
    up to max_tokens (inclusive).

    Small counts are profiled one by one because the curve is not smooth there:
    at one request on the CPU demo a forward costs the same for 1 to 6 tokens and
    rises at 7 (kernels tile the rows), and a curve interpolated between 4 and 8
    priced the 5th draft as much as the 7th, so the budgets could not see that the
    first five drafts are free and the last two are not."""
    sizes = set(range(1, min(every_up_to, max_tokens) + 1))
    n = max(every_up_to, 1)
    while n < max_tokens:
        sizes.add(n)
        n *= 2
    sizes.add(max_tokens)
    return sorted(sizes)
