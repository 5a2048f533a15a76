"""examples/round_times.py's pure part: pairing rounds with the reference."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "examples" / "round_times.py"


@pytest.fixture(scope="module")
def round_times():
    sys.path.insert(0, str(_PATH.parent))
    try:
        spec = importlib.util.spec_from_file_location("round_times", _PATH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_PATH.parent))
    return module


def test_pairs_take_the_adjacent_reference_round(round_times):
    # cycle 5,4,5,6: each 4 and 6 sits between two 5s; a pair is taken with
    # the 5 before it and with the 5 after it
    rounds = [(5, 10.0), (4, 9.0), (5, 10.0), (6, 11.0), (5, 10.0), (4, 9.0)]
    report = round_times.pair_report(rounds, 5)
    assert report[4]["pairs"] == 3 and report[6]["pairs"] == 2
    assert report[4]["mean_log_ratio"] == pytest.approx(math.log(0.9))
    assert report[6]["mean_log_ratio"] == pytest.approx(math.log(1.1))
    assert report[4]["sd"] == pytest.approx(0.0, abs=1e-12)
    assert report[5] == {"rounds": 3, "median_ms": 10.0}
