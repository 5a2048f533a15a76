"""The scheduler's per-step counters (RoundStats) and EMA admission control on
synthetic steps (no engine)."""

import math

import pytest

from adaflash_vllm.admission import AdmissionControl
from adaflash_vllm.config import AdmissionConfig
from adaflash_vllm.metrics import RoundStats


def test_round_stats_count_verified_and_accepted_positions():
    stats = RoundStats(4)
    stats.observe_rounds([4, 2, 0], [3, 2, 0])
    stats.observe_rounds([1], [0])
    snap = stats.snapshot()
    assert snap["rounds"] == 4
    assert snap["verified_tokens"] == 5 + 3 + 1 + 2
    assert snap["accepted_tokens"] == 5
    assert snap["verified_hist"] == [1, 1, 1, 0, 1]  # index = drafts verified
    assert snap["drafted_per_pos"] == [3, 2, 1, 1]
    assert snap["accepted_per_pos"] == [2, 2, 1, 0]
    # Both steps verified some draft: every round speculated.
    assert snap["speculative_rounds"] == 4
    assert snap["speculative_verified_tokens"] == snap["verified_tokens"]


def test_a_step_without_any_draft_is_not_a_speculating_step():
    """A step the draft gate skipped verifies no request's draft: its rounds count
    (tau 1 each) but not among speculating steps; a drafting step's rounds with
    k_i = 0 (the budgets' choice) still do."""
    stats = RoundStats(4)
    stats.observe_rounds([0, 0, 0], [0, 0, 0])  # skipped step
    stats.observe_rounds([4, 0], [2, 0])  # drafting step, one budget of 0
    snap = stats.snapshot()
    assert snap["rounds"] == 5 and snap["verified_tokens"] == 3 + 6
    assert snap["speculative_rounds"] == 2
    assert snap["speculative_verified_tokens"] == 6


def test_admission_tracks_requests_and_verify_length_by_ema():
    ctl = AdmissionControl(AdmissionConfig(beta=0.5, token_budget=64), 7)
    assert ctl.v_hat == 8.0  # full K until rounds are seen
    # Idle engine: the cap is budget / v_hat = 8, and it admits that many.
    assert ctl.limits(running=0, max_active=256, max_tokens=4096) == (8, 64)
    ctl.observe_rounds([7] * 8)
    ctl.end_step(8)
    assert ctl.n_hat == pytest.approx(4.0)
    assert ctl.v_hat == pytest.approx(8.0)
    # Budgets of 0 drafts: the verify length falls, so more requests fit.
    for _ in range(20):
        ctl.observe_rounds([0] * 8)
        ctl.end_step(8)
    assert ctl.v_hat == pytest.approx(1.0, abs=1e-4)
    assert ctl.n_hat == pytest.approx(8.0, abs=1e-4)
    limit, budget = ctl.limits(running=8, max_active=256, max_tokens=4096)
    assert ctl.cap == math.floor(64 / ctl.v_hat) >= 63  # was 8 at full K
    assert (limit, budget) == (8 + math.floor(ctl.cap - ctl.n_hat), 64)
    assert limit >= 63
    # vLLM's own limits still bind.
    assert ctl.limits(running=8, max_active=16, max_tokens=32) == (16, 32)


def test_admission_step_without_rounds_keeps_verify_length():
    ctl = AdmissionControl(AdmissionConfig(beta=0.3), 3)
    ctl.end_step(0)  # a prefill-only step: no rounds
    assert ctl.v_hat == 4.0 and ctl.n_hat == 0.0


def test_scheduler_counts_a_step_without_drafts_as_the_general_path_does():
    """A step where no request verifies a draft (the gate skipped) takes the
    scheduler's short path: the same counters and admission feedback as the
    per-round records, the same requests to check for finishing."""
    from types import SimpleNamespace

    from adaflash_vllm.scheduler import AdaFlashScheduler

    requests = {  # decode, decode, a prefill chunk, decode discarded, decode
        r: SimpleNamespace(num_output_tokens=n, num_tokens=10 + n)
        for r, n in (("a", 3), ("b", 1), ("c", 0), ("d", 5), ("e", 2))
    }
    step = SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in [*requests, "gone"]},
        scheduled_spec_decode_tokens={},
    )
    out = SimpleNamespace(
        sampled_token_ids=[[7], [8], [], [], [9]],
        req_id_to_index={r: i for i, r in enumerate(requests)},
    )

    def scheduler():
        return SimpleNamespace(
            requests=requests,
            round_stats=RoundStats(4),
            admission=AdmissionControl(AdmissionConfig(beta=0.5), 4),
            online=None,
        )

    general, short = scheduler(), scheduler()
    before = AdaFlashScheduler._decode_rounds_before(general, step)
    AdaFlashScheduler._record_rounds(general, before, out)
    got = AdaFlashScheduler._record_rounds_without_drafts(short, step, out)
    assert got == [request for request, _, _ in before.values()]
    counts = [{**s.round_stats.snapshot(), "time": 0} for s in (short, general)]
    assert counts[0] == counts[1]
    assert counts[0]["verified_hist"][0] == counts[0]["rounds"] == 3  # a, b, e
    for s in (general, short):
        s.admission.end_step(len(got))
    assert vars(short.admission) == vars(general.admission)
