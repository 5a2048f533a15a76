"""examples/acceptance_runs.py's pure parts: chains, medians, the report."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "examples" / "acceptance_runs.py"
_spec = importlib.util.spec_from_file_location("acceptance_runs", _PATH)
runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runs)


def test_chain_walks_rounds_as_greedy_verification_does():
    # K = 3: a round at p accepts a(p); the next starts at p + a(p) + 1
    by_anchor = {10: 3, 14: 0, 15: 2, 18: 1}
    # rounds at 10, 14, 15, 18, then 20..26 (each block must fit before 30)
    assert runs.chain_pairs(by_anchor, start=10, end=30, k=3) == [
        (3, 0),
        (0, 2),
        (2, 1),
        (1, 0),
        *[(0, 0)] * 6,
    ]


def test_median_is_the_longest_length_half_the_rounds_reach():
    assert runs.median_length([0, 0, 1, 7], 7) == 1
    assert runs.median_length([0, 0, 0, 7], 7) == 0
    assert runs.median_length([7, 7, 0], 7) == 7


def test_report_conditions_on_the_previous_round():
    pairs = [(7, 7)] * 10 + [(0, 0)] * 30 + [(0, 1)] * 10
    r = runs.report(pairs, 7)
    assert r["rounds"] == 50
    assert r["survival_after"]["7"]["S"] == [1.0] * 7
    assert r["survival_after"]["0"]["S"][0] == pytest.approx(0.25)
    # the constant median (0) misses every 7 and 1; by previous round, only the 1s
    assert r["mae_constant_median"] == pytest.approx((10 * 7 + 10) / 50 / 7)
    assert r["mae_previous_round_median"] == pytest.approx(10 / 50 / 7)
