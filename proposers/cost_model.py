"""What a decode step costs as a function of the tokens the target verifies.

Profiled once in the worker (timed dummy forwards at a ladder of token counts,
before the first real step) and refreshed online from real decode steps: the
proposer times consecutive steps whose batch did not change and moves the table
toward what it saw (EMA). The cost-aware budget policy only needs differences in
cost between token counts, plus the step's fixed part, both of which this gives.
"""

from __future__ import annotations

import bisect
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
        self.times_ms = [float(t) for t in times_ms]
        self.ema = ema
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
        return max(1e-6, t[i - 1] + (t[i] - t[i - 1]) * w)

    def many(self, n: np.ndarray) -> np.ndarray:
        """cost(n) for every element of n: the same curve in one vectorised pass
        (budgets evaluate it at every candidate slot count, B * K + 1 points)."""
        s = np.asarray(self.sizes, dtype=np.float64)
        t = np.asarray(self.times_ms, dtype=np.float64)
        x = np.asarray(n, dtype=np.float64)
        i = np.clip(np.searchsorted(s, x), 1, len(s) - 1)  # bisect_left, as _bracket
        w = (x - s[i - 1]) / (s[i] - s[i - 1])
        return np.maximum(t[i - 1] + (t[i] - t[i - 1]) * w, 1e-6)

    def observe(self, n: int, ms: float) -> None:
        """Move the curve at n toward a measured step (n tokens, ms): both table
        points around n, each by its interpolation weight (clamped outside the
        table), so that cost(n) itself converges to what steps take. The step's
        ratio to the curve is bounded by `max_step_ratio`."""
        if ms <= 0 or n <= 0:
            return
        i, w = self._bracket(n)
        bound = self.max_step_ratio
        ratio = min(bound, max(1.0 / bound, ms / self(n)))
        for j, weight in ((i - 1, 1.0 - w), (i, w)):
            weight = min(1.0, max(0.0, weight))
            self.times_ms[j] *= 1.0 + self.ema * weight * (ratio - 1.0)
        self._keep_monotone()
        self.observations += 1

    def _keep_monotone(self) -> None:
        for j in range(1, len(self.times_ms)):
            self.times_ms[j] = max(self.times_ms[j], self.times_ms[j - 1])

    @property
    def slope_ms_per_token(self) -> float:
        return (self.times_ms[-1] - self.times_ms[0]) / (self.sizes[-1] - self.sizes[0])

    def to_dict(self) -> dict:
        return {
            "sizes": self.sizes,
            "times_ms": self.times_ms,
            "observations": self.observations,
        }


def profile_step_costs(
    run: Callable[[int], object],
    sizes: list[int],
    *,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> StepCostModel:
    """Time `run(n)` (a dummy forward of n tokens) for each size; median of repeats."""
    times = []
    for n in sizes:
        run(n)  # warm-up
        samples = []
        for _ in range(repeats):
            if sync:
                sync()
            t0 = time.perf_counter()
            run(n)
            if sync:
                sync()
            samples.append(1e3 * (time.perf_counter() - t0))
        times.append(sorted(samples)[len(samples) // 2])
    for j in range(1, len(times)):  # noise must not make more tokens cheaper
        times[j] = max(times[j], times[j - 1])
    return StepCostModel(sizes, times)


def profile_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to max_tokens (inclusive)."""
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)
    return sorted(set(sizes))
