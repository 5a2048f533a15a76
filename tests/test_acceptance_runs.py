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


def test_two_rounds_forecast_scores_what_the_round_before_adds():
    # After a 0: a 7 follows when the round before the 0 was a 7, else a 0.
    # The previous round alone cannot tell these apart; the two rounds can.
    alternating, zeros = [7, 0, 7, 0, 7, 0, 7], [0] * 7
    chains = [alternating, zeros, zeros, alternating]  # each half has both
    r = runs.history_forecasts(chains, 7)
    assert r["previous_two_rounds"]["in_sample"] == 0.0
    assert r["previous_two_rounds"]["two_fold"] == 0.0
    assert r["previous_round"]["in_sample"] > 0.1
    # the previous round's cells: after a 7 always a 0 (exact); after a 0 the
    # median of {7 x 6, 0 x 12} is 0, missing the three 7s per alternating chain
    rows = runs.history_rows(chains)
    assert len(rows) == 24
    assert r["previous_round"]["in_sample"] == pytest.approx(6 * 7 / 24 / 7)


def test_two_fold_forecast_falls_back_where_a_half_lacks_a_cell():
    chains = [[7, 7, 7], [0, 0, 0]]  # each half has only one kind of history
    r = runs.history_forecasts(chains, 7)
    assert r["previous_round"]["in_sample"] == 0.0
    # half 0 (the 7s) predicts 7 for half 1's unseen cells: miss by 7, and back
    assert r["previous_round"]["two_fold"] == pytest.approx(1.0)
