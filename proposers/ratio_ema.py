"""EMAs of a numerator and a denominator, for ratios of sums.

Tokens per ms over rounds of different lengths, or realised over predicted
accepted drafts: the ratio of the two EMAs weights each observation by its size,
which an EMA of per-observation ratios would not. The first observation sets both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RatioEMA:
    ema: float
    num: float = 0.0
    den: float = 0.0
    count: int = 0

    def add(self, num: float, den: float) -> None:
        a = self.ema if self.count else 1.0
        self.num += a * (num - self.num)
        self.den += a * (den - self.den)
        self.count += 1

    def ratio(self) -> float | None:
        """num / den, or None before any observation (or while den <= 0)."""
        return self.num / self.den if self.count and self.den > 0 else None
