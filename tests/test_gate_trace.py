"""The gate tracer (examples/gate_trace/) and its reader (examples/gate_rounds.py)
on a real `BatchSizeGates` driven with synthetic rounds (no engine)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from adaflash_vllm.proposers.draft_gate import BatchSizeGates

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_traced_rounds_are_read_back_with_their_place_in_a_run(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAFLASH_GATE_TRACE", raising=False)
    # restored after the test: the tracer wraps the class's methods
    monkeypatch.setattr(BatchSizeGates, "should_draft", BatchSizeGates.should_draft)
    monkeypatch.setattr(BatchSizeGates, "record_round", BatchSizeGates.record_round)
    tracer = _load("gate_trace_site", EXAMPLES / "gate_trace" / "sitecustomize.py")
    reader = _load("gate_rounds", EXAMPLES / "gate_rounds.py")
    prefix = tmp_path / "gate"
    tracer._install(str(prefix))

    gates, modes, last = BatchSizeGates(), [], None
    for _ in range(60):
        if last is not None:  # drafting 1 token/ms, skipping 2: the gate skips
            rate = 1.0 if last else 2.0
            gates.record_round(drafted=last, tokens=16 * rate, ms=16.0)
        last = gates.should_draft(16)
        modes.append(last)

    got = reader.rounds(f"{prefix}.{os.getpid()}")
    assert len(got) == 59  # every round but the last step's
    assert [r[1] for r in got] == [int(m) for m in modes[:-1]]
    assert all(r[0] == 16 for r in got)
    # each round's place in its mode's run, as the decisions went
    run, places = 0, []
    for i, m in enumerate(modes[:-1]):
        run = run + 1 if i and m == modes[i - 1] else 1
        places.append(run)
    assert [r[4] for r in got] == places
    assert {r[2] / r[3] for r in got if r[1]} == {1.0}
    assert False in modes and True in modes  # both modes were traced
    # each decision is followed by its gate's state after it
    lines = Path(f"{prefix}.{os.getpid()}").read_text().splitlines()
    states = [line.split() for line in lines if line.startswith("G ")]
    assert len(states) == len([line for line in lines if line.startswith("S ")])
    assert [int(g[2]) for g in states] == list(range(1, 61))  # the gate's steps
    last = states[-1]
    assert float(last[5]) == 1.0 and float(last[6]) == 2.0  # drafting, skipping
    assert states[0][5] == states[0][6] == "-"  # nothing measured yet
    assert int(last[4]) >= 0


def test_round_positions_are_split_as_asked():
    reader = _load("gate_rounds", EXAMPLES / "gate_rounds.py")
    assert reader._position_span("4") == ("4", 4, 4)
    assert reader._position_span("2-5") == ("2-5", 2, 5)
    name, lo, hi = reader._position_span("11+")
    assert (name, lo) == ("11+", 11) and hi > 10**6


def test_closed_windows_are_split_where_the_batch_refills(tmp_path):
    reader = _load("gate_rounds", EXAMPLES / "gate_rounds.py")
    # two windows of 4 requests: the first drafts and drains to 1 request,
    # the second runs all 4 to the end; times in seconds, 10 ms a step
    decisions = [(4, 1), (4, 1), (2, 1), (1, 0), (4, 0), (4, 0), (4, 0)]
    path = tmp_path / "gate.1"
    path.write_text(
        "".join(
            f"S {0.01 * i:.6f} {n} {d} {d} 0 0\nG {n} {i} - 0 - -\n"
            for i, (n, d) in enumerate(decisions)
        )
    )
    got = reader.windows(str(path))
    assert [w["steps"] for w in got] == [4, 3]
    assert [w["drafted"] for w in got] == [3, 0]
    assert [w["full_steps"] for w in got] == [2, 3]
    assert [w["below_steps"] for w in got] == [2, 0]
    assert [w["small_steps"] for w in got] == [2, 0]
    # a step's time runs to the window's next decision (the last one has none)
    assert got[0]["full_ms"] == pytest.approx(20.0)
    assert got[0]["below_ms"] == pytest.approx(10.0)
    assert got[1]["full_ms"] == pytest.approx(20.0)
