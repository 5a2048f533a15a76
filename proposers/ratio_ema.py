"""EMAs of a numerator and a denominator, for ratios of sums.

Tokens per ms over rounds of different lengths, or realised over predicted
accepted drafts: the ratio of the two EMAs weights each observation by its size,
which an EMA of per-observation ratios would not.

Until `1 / ema` observations have come, each takes weight `1 / count`: the EMAs
are then the plain means of the observations so far. Seeded by the first
observation alone (as they were before), a slow EMA kept that one for long: at
`ema` 0.01, the draft gate's long-run rate at one request, the first round still
weighed 0.6 after 50 rounds, and the first rounds of a batch size run slow
(1.2-3x at one request on the CPU demo), which made skipping look as good as
drafting's "long-run" rate early in an engine's life.
"""

from __future__ import annotations

from dataclasses import dataclass


def running_weight(ema: float, seen: int, new: int = 1) -> float:
    """The weight of `new` observations arriving together, `seen` of them so far
    (these included), in an EMA of rate `ema` per observation that is the plain
    mean of its observations until about `1 / ema` of them have come."""
    return max(1.0 - (1.0 - ema) ** new, new / seen)


@dataclass
class RatioEMA:
    ema: float
    num: float = 0.0
    den: float = 0.0
    count: int = 0

    def add(self, num: float, den: float) -> None:
        self.add_many(num, den, 1)

    def add_many(self, num: float, den: float, n: int) -> None:
        """`n` observations at once, each of mean `num` and `den` (weighted
        alike among themselves: `running_weight` of `n` new ones)."""
        if n <= 0:
            return
        a = running_weight(self.ema, self.count + n, n)
        self.num += a * (num - self.num)
        self.den += a * (den - self.den)
        self.count += n

    def ratio(self) -> float | None:
        """num / den, or None before any observation (or while den <= 0)."""
        return self.num / self.den if self.count and self.den > 0 else None
