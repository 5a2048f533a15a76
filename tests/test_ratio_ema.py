"""RatioEMA: ratios of sums, the plain mean of the first observations."""

import pytest
from adaflash_vllm.proposers.ratio_ema import RatioEMA


def test_none_before_any_observation():
    assert RatioEMA(0.3).ratio() is None


def test_the_first_observations_are_averaged_then_it_moves_as_an_ema():
    slow = RatioEMA(0.01)
    slow.add(1.0, 10.0)  # one slow first round: 0.1 tokens per ms
    for _ in range(49):
        slow.add(3.0, 10.0)
    # the plain mean of 50 rounds, where an EMA seeded by the first kept 0.6 of it
    assert slow.ratio() == pytest.approx((1.0 + 49 * 3.0) / 500.0)
    fast = RatioEMA(0.5)
    for num in (1.0, 3.0, 5.0):
        fast.add(num, 1.0)
    # weights 1, 1/2, then 0.5: ((1 + 3) / 2 + 5) / 2
    assert fast.ratio() == pytest.approx(3.5)


def test_ratio_of_sums_weighs_longer_observations_more():
    r = RatioEMA(0.5)
    r.add(10.0, 1.0)
    r.add(10.0, 9.0)
    assert r.ratio() == pytest.approx(20.0 / 10.0)
