"""The steady skipping state (proposers/steady_skip.py), engine-free: when it
starts and holds, that its short steps leave the gate's verdicts and counters
as full skipped steps would, what it folds back, and the proposer's short path
(holes marked as a full skipped step marks them, the last step kept for the
next full one)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from adaflash_vllm.proposers.cost_model import StepCostModel
from adaflash_vllm.proposers.draft_gate import BatchSizeGates
from adaflash_vllm.proposers.retired_context import RetiredContext
from adaflash_vllm.proposers.steady_skip import MIN_BATCH, SteadySkip

IDS = [f"r{i}" for i in range(16)]


def _skipping_gates(next_check_in: int = 40) -> BatchSizeGates:
    """Gates whose bucket of 16 requests follows skipping (measured), with its
    next check of drafting `next_check_in` steps away."""
    gates = BatchSizeGates()
    gates.should_draft(16)
    gate = gates.current
    gate.drafting, gate.switch_batch = False, 16
    gate.explore_at = gate.step + next_check_in
    for _ in range(3):
        gate.record_round(drafted=False, tokens=16, ms=8.0)
    return gates


def _enter(gates, req_ids=IDS):
    return SteadySkip.enter(gates, req_ids=list(req_ids), started=1.0, ended=1.001)


def test_starts_only_where_the_gate_is_steady():
    assert _enter(_skipping_gates()) is not None
    for change in (
        {"drafting": True},  # following drafting
        {"check_waiting": True},  # a check of drafting waits
        {"exploring_until": 10**6},  # exploring the other mode
    ):
        gates = _skipping_gates()
        for name, value in change.items():
            setattr(gates.current, name, value)
        assert _enter(gates) is None, change
    assert _enter(_skipping_gates(next_check_in=1)) is None  # a check is due next
    assert _enter(_skipping_gates(), IDS[: MIN_BATCH - 1]) is None  # few requests
    assert _enter(_skipping_gates(), IDS[:MIN_BATCH]) is not None
    assert _enter(types.SimpleNamespace(current=None)) is None  # a scripted gate


@pytest.mark.parametrize(
    "num_reqs, holds",
    [
        (16, True),
        (15, True),  # same bucket (14, 16]
        (12, False),  # another bucket, and shrunk by a quarter since the switch
        (17, False),  # another bucket
    ],
)
def test_holds_while_the_verdict_cannot_change(num_reqs, holds):
    assert _enter(_skipping_gates()).holds(num_reqs) is holds


def test_ends_before_the_step_whose_check_is_due():
    gates = _skipping_gates(next_check_in=4)
    steady = _enter(gates)
    held = []
    for t in range(5):
        held.append(steady.holds(16))
        if held[-1]:
            steady.skip(IDS, 16, 2.0 + t, True)
    assert held == [True, True, True, False, False]  # the 4th step checks


def _verdicts(gates, *, steady_path: bool, steps: int, batch=lambda t: 16):
    """The gate's verdict at each step: full steps only, or short ones while
    the steady state holds (entered after a full skipped step); and how many
    steps were short."""
    out, steady, short = [], None, 0
    for t in range(steps):
        n = batch(t)
        if steady is not None and steady.holds(n):
            steady.skip(IDS[:n], n, float(t), IDS[:n] == steady.req_ids)
            out.append(False)
            short += 1
            continue
        if steady is not None:
            steady.fold(None)
            steady = None
        draft = gates.should_draft(n)
        if not draft:
            gates.current.record_round(drafted=False, tokens=n, ms=8.0)
        out.append(draft)
        if steady_path and not draft:
            steady = SteadySkip.enter(
                gates, req_ids=IDS[:n], started=float(t), ended=t + 0.001
            )
    return out, short


@pytest.mark.parametrize(
    "batch",
    [
        lambda t: 16,  # steady load: the check of drafting comes due
        lambda t: 16 if t < 25 else 11,  # the batch shrank: a check at once
        lambda t: 16 if t % 7 else 15,  # within the bucket (14, 16]
    ],
)
def test_short_steps_give_the_verdicts_and_counters_of_full_ones(batch):
    full, short = _skipping_gates(), _skipping_gates()
    want, _ = _verdicts(full, steady_path=False, steps=60, batch=batch)
    got, short_steps = _verdicts(short, steady_path=True, steps=60, batch=batch)
    assert got == want
    # not vacuous: most skipped steps took the short path, and a check of
    # drafting ran
    assert short_steps > got.count(False) // 2 and True in got
    assert short.steps == full.steps
    for bucket, gate in full.gates.items():
        other = short.gates[bucket]
        assert (other.step, other.skipped_steps, other.drafted_steps) == (
            gate.step,
            gate.skipped_steps,
            gate.drafted_steps,
        ), bucket
        assert other.seen_at == gate.seen_at and other.explore_at == gate.explore_at


def test_fold_takes_unchanged_rounds_and_decode_steps_once_as_means():
    gates = _skipping_gates()
    gate = gates.current
    rounds = gate.skip_rate.count
    cost = StepCostModel([1, 16, 32], [5.0, 8.0, 12.0])
    steady = SteadySkip.enter(gates, req_ids=IDS, started=1.000, ended=1.001)
    # three steps of the same 16 requests, 10 ms apart, each propose 0.5 ms
    for t in (1.010, 1.020, 1.030):
        steady.skip(list(IDS), 16, t, True)
        steady.end_step(t + 0.0005)
    # a request finished and another arrived with its prompt (40 tokens): the
    # proposer credits that round (`_credit_round`), not `skip`
    steady.skip(IDS[:15] + ["new"], 55, 1.045, False)
    steady.end_step(1.0455)
    assert (steady.steps, steady.rounds, steady.costed) == (4, 3, 3)
    full = copy.deepcopy(gate)
    observed = cost.observations
    steady.fold(cost)
    # as three skipped rounds of 16 tokens in 10 ms, one after the other
    for _ in range(3):
        full.record_round(drafted=False, tokens=16, ms=10.0)
    assert gate.skip_rate.count == rounds + 3
    assert gate.skip_rate.ratio() == pytest.approx(full.skip_rate.ratio())
    assert gate.rate_noise(False) == pytest.approx(full.rate_noise(False))
    assert cost.observations == observed + 1
    # each decode step: 9 ms from the last propose's end (9.5 for the first)
    assert cost.level_ms == pytest.approx(0.3 * ((9.0 + 9.5 + 9.5) / 3 - 8.0))
    assert gate.context_ms == pytest.approx(0.5)


def test_fold_without_credited_rounds_learns_nothing_but_the_propose_time():
    gates = _skipping_gates()
    gate = gates.current
    before = copy.deepcopy(gate.skip_rate)
    steady = _enter(gates)
    steady.skip(IDS[:15], 15, 1.01, False)  # a request finished
    steady.end_step(1.0102)
    steady.fold(StepCostModel([1, 32], [5.0, 12.0]))
    assert gate.skip_rate == before
    assert gate.context_ms == pytest.approx(0.2)


def test_rounds_recorded_at_once_match_rounds_recorded_one_by_one():
    """`record_skipped_rounds`: n rounds weighted alike. Past the gate's first
    1 / ema rounds (its plain means) n equal rounds move its rates exactly as n
    calls of `record_round` do; their spread enters the rate's noise."""
    one, many = _skipping_gates(), _skipping_gates()
    for gates in (one, many):
        for _ in range(6):
            gates.current.record_round(drafted=False, tokens=16, ms=9.0)
    for _ in range(5):
        one.current.record_round(drafted=False, tokens=16, ms=8.0)
    many.current.record_skipped_rounds(
        rounds=5, tokens=16, ms=8.0, rate=2.0, rate_sq=4.0
    )
    a, b = one.current, many.current
    assert b.skip_rate.ratio() == pytest.approx(a.skip_rate.ratio())
    assert b.skip_rate.count == a.skip_rate.count
    assert b.rate_moments[False] == pytest.approx(a.rate_moments[False])
    assert b.skip_measured_at == b.step
    # rounds that spread: their noise is the spread's, not that of their mean
    calm, spread = copy.deepcopy(many), copy.deepcopy(many)
    calm.current.record_skipped_rounds(
        rounds=5, tokens=16, ms=8.0, rate=2.0, rate_sq=4.0
    )
    spread.current.record_skipped_rounds(
        rounds=5, tokens=16, ms=8.0, rate=2.0, rate_sq=4.5
    )
    assert spread.current.rate_noise(False) > calm.current.rate_noise(False)


def _four_requests(gates) -> SteadySkip:
    """The state over four requests (built directly: `enter` starts it only
    from MIN_BATCH requests on; the proposer's path does not depend on it)."""
    return SteadySkip(gates, gates.current, 4, list("abcd"), 4.0, 4.001)


def _short_path_proposer(gates):
    """A stand-in proposer for `_skip_steadily` / `_leave_steady`: four requests
    in decode, cache blocks of 4 slots."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    proposer = types.SimpleNamespace(
        retired=RetiredContext(4),
        cost_model=None,
        steady_steps=0,
        _steady=None,
        _last_propose=None,
        _synced_clock=lambda: 5.0,
        _runner=types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=["a", "b", "c", "d", "gone"])
        ),
    )
    for name in ("_retire_every_row", "_credit_round"):
        method = getattr(AdaFlashProposer, name)
        setattr(proposer, name, lambda *a, _m=method: _m(proposer, *a))
    proposer._steady_last = AdaFlashProposer._steady_last
    # the full skipped step that entered the state retired its requests
    proposer.retired.retire(list("abcd"), [])
    return proposer


def test_the_short_path_marks_holes_and_leaves_the_last_step_for_the_next():
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    gates = _skipping_gates()
    proposer = _short_path_proposer(gates)
    steady = _four_requests(gates)
    slots = torch.tensor([3, 8, 13, 22, -1, -1])[:4]  # the step's 4 tokens
    out = AdaFlashProposer._skip_steadily(proposer, steady, 4, 4, lambda: slots)
    assert out == list("abcd")
    # every request retired, each token's block marked, as `_retire_rows`
    # marks them on a full skipped step
    full = RetiredContext(4)
    full.retire(list("abcd"), [3, 8, 13, 22])
    assert proposer.retired.retired == full.retired == set("abcd")
    assert proposer.retired.holey == full.holey == {0, 2, 3, 5}
    assert proposer.steady_steps == 1 and gates.current.skipped_steps == 1
    proposer._steady = steady
    AdaFlashProposer._leave_steady(proposer)
    last = proposer._last_propose
    assert proposer._steady is None
    assert (last.ended, last.batch, last.drafted, last.after_drafted) == (
        5.0,
        frozenset("abcd"),
        False,
        False,
    )
    assert last.budgets == dict.fromkeys("abcd", 0)
    AdaFlashProposer._leave_steady(proposer)  # (not in the state: nothing)
    assert proposer._last_propose is last


def test_a_round_whose_batch_changed_is_credited_as_a_full_step_credits_it():
    """ "d" finished (the runner's batch is a, b, c): the round of the last step
    emitted its 4 tokens in the whole time from its start (`_credit_round`);
    then "e" arrives with a 9-token prompt: the prompt's share of the step,
    cost(12) - cost(3), is taken out, as on a full step. Neither is a step
    that the cost curve learns from."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    gates = _skipping_gates()
    proposer = _short_path_proposer(gates)
    proposer.cost_model = StepCostModel([1, 32], [5.0, 36.0])  # 1 ms per token
    steady = _four_requests(gates)
    batch = proposer._runner.input_batch
    clock = iter([4.010, 4.030])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("time.perf_counter", lambda: next(clock))
        batch.req_ids = ["a", "b", "c"]
        AdaFlashProposer._skip_steadily(
            proposer, steady, 3, 3, lambda: torch.tensor([3, 8, 13])
        )
        batch.req_ids = ["a", "b", "c", "e"]
        AdaFlashProposer._skip_steadily(
            proposer, steady, 4, 12, lambda: torch.arange(12)
        )
    assert steady.rounds == 2 and steady.costed == 0
    assert steady.round_tokens == 4 + 3
    assert steady.round_ms == pytest.approx(10.0 + (20.0 - 9.0))


def test_plain_step_only_where_the_short_path_would_run():
    """`plain_step` (patches.py W10) says yes exactly where `propose_early`
    would take the short path for the step's batch; `end_plain_step` then runs
    that path (counted, holes marked) with the slots the runner hands over."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    gates = _skipping_gates()
    proposer = _short_path_proposer(gates)
    proposer.__dict__.update(
        steady_plain=True,
        plain_steps=0,
        captures=None,
        timeline=None,
        retire_when_skipping=True,
        _steady_holds=lambda n: AdaFlashProposer._steady_holds(proposer, n),
        _skip_steadily=lambda *a: AdaFlashProposer._skip_steadily(proposer, *a),
    )
    ids = [f"r{i}" for i in range(17)]

    def step(num_reqs, tokens=None):
        scheduled = dict.fromkeys(ids[:num_reqs], 1)
        return types.SimpleNamespace(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=num_reqs if tokens is None else tokens,
        )

    def plain(scheduler_output):
        return AdaFlashProposer.plain_step(proposer, scheduler_output)

    assert not plain(step(16))  # not in the steady state
    proposer._steady = _enter(gates, ids[:16])
    assert plain(step(16)) and plain(step(15))
    assert not plain(step(17))  # another bucket: a full step
    assert not plain(step(16, tokens=0))  # nothing to run
    for name, value in (
        ("steady_plain", False),
        ("captures", []),
        ("timeline", []),
        ("retire_when_skipping", False),
    ):
        saved = getattr(proposer, name)
        setattr(proposer, name, value)
        assert not plain(step(16)), name
        setattr(proposer, name, saved)
    proposer._runner.input_batch.req_ids = ids[:16]
    proposer.retired.retired = set(ids[:16])  # (the step that entered the state)
    proposer._runner.rejection_sampler = types.SimpleNamespace(
        record_bonus_only=lambda n: counted.append(n)
    )
    counted, proposer._budgets = [], {"r0": 3}
    AdaFlashProposer.end_plain_step(proposer, 16, 16, lambda: torch.arange(16))
    assert proposer.plain_steps == proposer.steady_steps == 1
    # its 16 rounds verified no draft; it leaves no budgets (its output
    # carries no drafts: patches.py W5)
    assert counted == [16] and proposer._budgets is None
    assert proposer.retired.retired == set(ids[:16]) and proposer.retired.holey == {
        0,
        1,
        2,
        3,
    }


def test_decode_steps_within_marked_blocks_read_no_slot():
    """A decode step of the last step's batch whose every token lands in the
    block of the request's previous token (marked already) reads no cache
    slot; the holes and counters end exactly as when every step reads its
    slots. Cache blocks of 4 slots: after slots 1, 8, 13, 22 (offsets 1, 0, 1,
    2) the next step stays in those blocks, the one after it does not (22 ->
    23 -> a new block); a step whose batch changed, or with more tokens than
    requests, always reads its slots."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    gates = _skipping_gates()
    proposer = _short_path_proposer(gates)
    proposer._runner.input_batch.req_ids = list("abcd")
    steady = _four_requests(gates)
    reads = []  # the steps that read their slots, by index

    def step(index, slots, num_reqs=4, num_tokens=4):
        def read():
            reads.append(index)
            return torch.tensor(slots)

        AdaFlashProposer._skip_steadily(proposer, steady, num_reqs, num_tokens, read)

    every = [[1, 8, 13, 22], [2, 9, 14, 23], [3, 10, 15, 40], [4, 11, 16, 41]]
    for index, slots in enumerate(every):
        step(index, slots)
    assert reads == [0, 2, 3]  # the second step read nothing
    full = RetiredContext(4)
    full.retire(list("abcd"), [s for slots in every for s in slots])
    assert proposer.retired.holey == full.holey
    assert proposer.retired.dropped_tokens == 16
    assert gates.current.skipped_steps == 4 and proposer.steady_steps == 4
    # a step with a prompt chunk (more tokens than requests) reads its slots
    step(4, list(range(44, 52)), num_tokens=8)
    assert reads[-1] == 4 and steady.quiet == 0
    assert proposer.retired.dropped_tokens == 24
    # a decode step leaves one quiet step (offsets 1, 0, 0, 2), but "d" has
    # finished: the batch changed, and the step reads its slots
    step(5, [53, 60, 64, 74])
    assert reads[-1] == 5 and steady.quiet == 1
    proposer._runner.input_batch.req_ids = list("abc")
    step(6, [54, 61, 65], num_reqs=3, num_tokens=3)
    assert reads[-1] == 6 and proposer.retired.dropped_tokens == 31
