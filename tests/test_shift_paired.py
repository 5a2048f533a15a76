"""examples/shift_paired.py's pure part: two configurations of one shift
stream compared window by window."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "examples" / "shift_paired.py"


@pytest.fixture(scope="module")
def shift_paired():
    spec = importlib.util.spec_from_file_location("shift_paired", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _points(taus, phase="a", rounds=10):
    return [
        {"key": i, "phase": phase, "tau": t, "rounds": rounds}
        for i, t in enumerate(taus)
    ]


def test_the_ratio_is_per_window_and_its_interval_follows_the_spread(shift_paired):
    base = _points([2.0, 3.0, 2.0, 3.0])
    even = _points([2.2, 3.3, 2.2, 3.3])  # every window 10% up: no spread
    mean, half = shift_paired.paired_ratio(base, even)
    assert mean == pytest.approx(1.1) and half == pytest.approx(0.0, abs=1e-12)
    mixed = _points([2.0, 3.6, 2.0, 3.6])  # 1.0, 1.2, 1.0, 1.2
    mean, half = shift_paired.paired_ratio(base, mixed)
    assert mean == pytest.approx(1.1)
    assert half == pytest.approx(1.96 * 0.11547 / 2, rel=1e-3)


def test_tau_is_weighted_by_rounds(shift_paired):
    points = _points([2.0, 4.0])
    points[1]["rounds"] = 30
    assert shift_paired.weighted_tau(points) == pytest.approx(3.5)


def test_streams_of_other_windows_are_refused(shift_paired, tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"points": _points([2.0, 3.0])}))
    (tmp_path / "b.json").write_text(json.dumps({"points": _points([2.0])}))
    import sys

    argv, sys.argv = sys.argv, ["shift_paired.py", str(tmp_path), "--configs", "a,b"]
    try:
        with pytest.raises(SystemExit, match="same windows"):
            shift_paired.main()
    finally:
        sys.argv = argv


def test_a_set_served_again_is_a_phase_of_its_own(shift_paired):
    points = _points([2.0, 2.0], "prose") + _points([1.0], "math")
    points += _points([1.5, 1.5, 1.5], "prose")
    got = [(name, len(run)) for name, run in shift_paired.phases(points)]
    assert got == [("prose", 2), ("math", 1), ("prose (again)", 3)]
