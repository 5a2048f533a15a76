"""The draft gate on synthetic step timings (no engine)."""

import pytest
from adaflash_vllm.proposers.draft_gate import DraftGate, ScriptedDraftGate


def _draft_step(gate, *, b=64, tokens, verify_ms=40.0, draft_ms=20.0, plain_ms=30.0):
    return gate.record_draft(
        num_reqs=b,
        expected_tokens=tokens,
        verify_ms=verify_ms,
        draft_ms=draft_ms,
        plain_verify_ms=plain_ms,
    )


def _run(gate, steps, b=64):
    return [gate.should_draft(b) for _ in range(steps)]


def test_drafts_while_drafting_pays():
    gate = DraftGate()
    for _ in range(20):
        assert gate.should_draft(64)
        # 150 tokens in 60 ms beats 64 tokens in 30 ms
        assert _draft_step(gate, tokens=150.0)
    assert gate.skipped_steps == 0


def test_skips_when_plain_decoding_wins_and_backs_off():
    gate = DraftGate(min_interval=4, max_interval=16)
    assert gate.should_draft(64)
    assert not _draft_step(gate, tokens=100.0)  # 100 / 60 ms < 64 / 30 ms
    # 3 skipped steps, then a probe on the 4th
    assert _run(gate, 4) == [False, False, False, True]
    assert not _draft_step(gate, tokens=100.0)  # the probe lost: interval 8
    assert _run(gate, 8) == [False] * 7 + [True]
    assert not _draft_step(gate, tokens=100.0)  # 16
    assert _run(gate, 16) == [False] * 15 + [True]
    assert not _draft_step(gate, tokens=100.0)  # capped at 16
    assert _run(gate, 16) == [False] * 15 + [True]
    assert _draft_step(gate, tokens=200.0)  # the probe won: draft again
    assert _run(gate, 5) == [True] * 5
    assert gate.to_dict()["interval"] == 4


def test_context_cost_counts_against_plain():
    gate = DraftGate()
    gate.should_draft(8)
    # 8 tokens in 10 ms vs 12 in 20 ms: plain wins ...
    assert not _draft_step(
        gate, b=8, tokens=12.0, verify_ms=15, draft_ms=5, plain_ms=10
    )
    gate.record_skip(15.0)  # ... until skipped steps turn out to cost 15 ms more
    assert gate.context_ms == 15.0
    gate.should_draft(8)
    assert _draft_step(gate, b=8, tokens=12.0, verify_ms=15, draft_ms=5, plain_ms=10)


def test_shrinking_batch_probes_at_once():
    gate = DraftGate(min_interval=8)
    gate.should_draft(64)
    _draft_step(gate, tokens=100.0)
    assert not gate.should_draft(60)
    assert gate.should_draft(48)  # a quarter fewer requests: re-measure now


def test_scripted_gate():
    gate = ScriptedDraftGate(3)
    assert _run(gate, 6) == [False, False, True, False, False, True]
    assert gate.to_dict()["skipped_steps"] == 4
    with pytest.raises(ValueError, match="draft_every"):
        ScriptedDraftGate(0)
