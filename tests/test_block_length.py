"""The drafter's block length per step (proposers/block_length.py), engine-free:
synthetic per-position survivals and round times, with a machine whose speed
swings."""

from __future__ import annotations

import math
import random

import pytest
from adaflash_vllm.proposers.block_length import BlockLength, PositionSurvival

K = 7

# S_j of prose at one request (the 6th and 7th drafts add ~0.08 tokens a round)
PROSE = [0.6, 0.42, 0.3, 0.2, 0.13, 0.05, 0.03]
EASY = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65]


def _kink_round(n: int, b: int) -> float:
    """One request on the CPU demo: a round costs the same up to L = 5 and
    0.3 ms more for each of the 6th and 7th slots."""
    return 8.0 + 0.3 * max(0, n - 5)


def _block(**kw) -> BlockLength:
    return BlockLength(full=K, warmup_steps=0, **kw)


def _run(
    block,
    steps,
    num_reqs,
    survival,
    round_ms,
    *,
    jitter=0.0,
    seed=0,
    speed=lambda step: 1.0,
):
    """`steps` drafting steps, each round timed as the next step would:
    round_ms(L, B) times the machine's `speed(step)`, times 1 +- `jitter`.
    Returns the lengths run."""
    rng = random.Random(seed)
    lengths = []
    for step in range(steps):
        n = block.next_length(num_reqs)
        lengths.append(n)
        ms = round_ms(n, num_reqs) * speed(step) * (1 + rng.uniform(-jitter, jitter))
        block.record_round(length=n, num_reqs=num_reqs, round_ms=ms, survival=survival)
    return lengths


def test_position_survival_takes_deltas_of_the_samplers_counts():
    s = PositionSurvival(3, per_round=1.0)
    s.update([0, 0, 0], [0, 0, 0])
    assert s.survival() is None
    s.update([10, 10, 4], [6, 3, 1])  # 10 rounds verified 2 drafts, 4 verified 3
    assert s.survival() == pytest.approx([0.6, 0.3, 0.25])
    s.update([20, 20, 4], [16, 5, 1])  # position 3 not verified again: kept
    assert s.survival() == pytest.approx([1.0, 0.2, 0.2])  # non-increasing


def test_position_survival_weighs_each_round():
    """A step of 32 rounds moves the estimate as 32 one-round steps would."""
    one, many = PositionSurvival(1, 0.01), PositionSurvival(1, 0.01)
    for s in (one, many):
        s.update([0], [0])
        s.update([100], [100])  # S_1 = 1 to start
    for i in range(1, 33):
        one.update([100 + i], [100])
    many.update([132], [100])
    assert one.survival() == pytest.approx(many.survival())
    assert one.survival()[0] == pytest.approx(0.99**32)


def test_survival_given_as_a_method_is_read_only_when_a_trial_decides():
    """The proposer hands `PositionSurvival.survival` itself: the S_j are folded
    on the steps where a trial decides, not on every drafting step; the
    lengths chosen are the same as with the values."""
    reads = []

    def survival():
        reads.append(1)
        return PROSE

    lazy, eager = _block(trial_rounds=4), _block(trial_rounds=4)
    lengths = _run(lazy, 80, 1, survival, _kink_round)
    assert lengths == _run(eager, 80, 1, PROSE, _kink_round)
    assert 0 < len(reads) < 80 // 4


def test_position_survival_is_the_mean_of_its_first_rounds():
    """A first round that accepted nothing must not stand for ~100 rounds: over
    the first rounds the estimate is their plain mean."""
    s = PositionSurvival(1, 0.01)
    s.update([0], [0])
    s.update([1], [0])  # the first round: rejected
    for i in range(2, 21):  # 19 accepted
        s.update([i], [i - 1])
    assert s.survival()[0] == pytest.approx(19 / 20)


def test_warmup_then_trials_alternate_the_two_lengths():
    block = BlockLength(full=K, warmup_steps=3, trial_rounds=2)
    lengths = _run(block, 7, 1, PROSE, _kink_round)
    assert lengths == [K, K, K, K, K - 1, K, K - 1]


def test_the_kink_at_the_sixth_slot_leads_down_to_five_drafts():
    """Slots 6 and 7 bring 0.08 tokens for 0.6 ms of an 8 ms round: L = 5."""
    block = _block()
    _run(block, 1500, 1, PROSE, _kink_round, jitter=0.05)
    b = block.buckets[1]
    assert b.length == 5 and b.switches == 2, block.to_dict()


def test_easy_text_keeps_the_full_block():
    block = _block()
    _run(block, 1500, 1, EASY, _kink_round, jitter=0.05)
    assert block.buckets[1].length == K


def test_flat_round_time_keeps_the_full_block():
    block = _block()
    _run(block, 1500, 1, PROSE, lambda n, b: 8.0, jitter=0.05)
    assert block.buckets[1].length == K


def test_steep_rounds_under_load_pick_a_short_block():
    """32 requests; verification and drafting cost 0.6 ms per slot per request
    on a 20 ms step: the first two slots pay, the rest do not."""
    block = _block()
    _run(block, 3000, 32, PROSE, lambda n, b: 20.0 + 0.6 * b * n, jitter=0.05)
    assert 1 <= block.buckets[32].length <= 2, block.to_dict()


def test_the_machines_speed_swings_do_not_mislead_the_trials():
    """The machine's speed swings by +-30% over ~100 steps, far more than L
    moves a round (7%): the trials' turns see the same machine, and L* still
    comes down to 5."""

    def speed(step: int) -> float:
        return 1.0 + 0.3 * ((step // 50) % 3 - 1)

    block = _block()
    _run(block, 2000, 1, PROSE, _kink_round, jitter=0.05, speed=speed)
    assert block.buckets[1].length == 5


def test_trials_back_off_while_the_choice_holds():
    block = _block(min_interval=4, max_interval=32, trial_rounds=4)
    lengths = _run(block, 600, 1, PROSE, lambda n, b: 8.0)
    b = block.buckets[1]
    assert b.length == K and b.interval == 32
    off = [i for i, n in enumerate(lengths) if n != K]
    assert len(off) < 0.15 * len(lengths)
    assert {lengths[i] for i in off} == {K - 1}  # L* - 1 (L* + 1 does not exist)


def test_buckets_choose_apart():
    block = _block()
    _run(block, 1500, 1, EASY, _kink_round, jitter=0.05)
    _run(block, 3000, 32, PROSE, lambda n, b: 20.0 + 0.6 * b * n, jitter=0.05)
    assert block.buckets[1].length == K and block.buckets[32].length <= 2


def test_no_choice_without_survivals():
    block = _block(trial_rounds=2)
    _run(block, 200, 1, None, _kink_round)
    b = block.buckets[1]
    assert b.length == K and b.trials == 0


def test_k_min_bounds_the_shortest_block():
    block = _block(k_min=3)
    lengths = _run(block, 3000, 32, PROSE, lambda n, b: 20.0 + 0.6 * b * n, jitter=0.05)
    assert min(lengths) >= 3 and block.buckets[32].length == 3


def test_rounds_of_another_bucket_or_length_are_not_counted():
    block = _block(trial_rounds=2)
    _run(block, 1, 1, PROSE, _kink_round)  # starts a trial K vs K - 1: K's turn
    b = block.buckets[1]
    assert b.open_star == 8.6 and b.pairs == []
    assert block.next_length(1) == K - 1
    block.record_round(length=3, num_reqs=1, round_ms=1.0, survival=PROSE)
    block.record_round(length=K - 1, num_reqs=2, round_ms=1.0, survival=PROSE)
    assert b.pairs == []
    block.record_round(length=K - 1, num_reqs=1, round_ms=8.3, survival=PROSE)
    assert b.pairs == [(8.6, 8.3)]
    # a round recorded twice, or one no turn asked for, is not a pair's
    block.record_round(length=K - 1, num_reqs=1, round_ms=8.3, survival=PROSE)
    assert b.pairs == [(8.6, 8.3)]


def test_a_full_block_after_a_full_accept_is_not_a_trials_turn():
    block = _block(trial_rounds=2)
    _run(block, 1, 1, PROSE, _kink_round)  # the trial K vs K - 1 began
    b = block.buckets[1]
    assert block.next_length(1, after_full_accept=True) == K
    block.record_round(length=K, num_reqs=1, round_ms=99.0, survival=PROSE)
    assert b.open_star == 8.6  # the extended round's time was not taken


def test_paired_gain_weighs_tokens_against_paired_times():
    from adaflash_vllm.proposers.block_length import paired_gain

    s = [0.5, 0.5, 0.0]  # L = 2 emits 2 tokens a round, L = 1 1.5
    # L' = 1 rounds 10% faster in every pair: ln(1.5 / 2) - ln(0.9)
    pairs = [(10.0, 9.0), (20.0, 18.0), (5.0, 4.5)]
    gain, se = paired_gain(pairs, s, 2, 1)
    assert gain == pytest.approx(math.log(1.5 / 2) - math.log(0.9))
    assert se == pytest.approx(0.0, abs=1e-12)
    # one pair where the machine paused is clipped to the others' spread
    noisy = [(10.0, 10.0 * (1 + 0.01 * (i % 3 - 1))) for i in range(30)]
    clean_gain, _ = paired_gain(noisy, s, 2, 2)
    paused_gain, _ = paired_gain([*noisy, (10.0, 40.0)], s, 2, 2)
    assert abs(paused_gain - clean_gain) < 0.01  # unclipped: 0.045


def test_a_clear_win_switches_after_the_first_pairs():
    """L' 8% faster for the same tokens, 3% noise: decided at 16 pairs."""
    block = _block()
    flat = [0.5, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]  # drafts past 2 are never accepted
    _run(block, 16 + 32, 1, flat, lambda n, b: 8.0 * (1 + 0.08 * (n - 6)), jitter=0.03)
    b = block.buckets[1]
    assert b.length == K - 1 and b.switches == 1, block.to_dict()
    assert b.last_trial["pairs"] == 16


def test_lengths_one_percent_apart_stay_put_under_noise():
    """L = 4 delivers 1% fewer tokens per ms than L = 5 (and L = 6, 7 6% fewer),
    round times +-8.5% (5% sd): trials keep 5 or end undecided, and their turns
    at other lengths cost under 0.5%. A 16-round median comparison picked 4 in
    about a third of such runs (BENCHMARKS.md run 25)."""
    s = [0.23, 0.115, 0.06, 0.035, 0.028, 0.0, 0.0]
    relative_rate = {4: 1 / 1.01, 5: 1.0, 6: 1 / 1.06, 7: 1 / 1.06}

    def round_ms(n, b):  # the round time that gives L its relative rate
        return 8.0 * (1 + sum(s[:n])) / (1 + sum(s[:5])) / relative_rate.get(n, 1.0)

    ends = []
    for seed in range(20):
        block = _block()
        block._bucket(1).length = 5  # as if it had come down to 5
        lengths = _run(block, 3000, 1, s, round_ms, jitter=0.085, seed=seed)
        ends.append(block.buckets[1].length)
        efficiency = sum(relative_rate.get(n, 1.0) for n in lengths) / len(lengths)
        assert efficiency > 0.995, (seed, block.to_dict())
    assert ends.count(5) >= 18, ends


def test_an_undecided_trial_keeps_the_length():
    block = _block(max_trial_rounds=32)
    same = [0.5, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]
    _run(block, 200, 1, same, lambda n, b: 8.0, jitter=0.3, seed=3)
    b = block.buckets[1]
    assert b.undecided >= 1 and b.length == K, block.to_dict()
    assert b.last_trial is not None and b.last_trial["pairs"] <= 32


def test_a_fully_accepted_round_is_followed_by_the_full_block():
    """After a round that accepted every draft the step drafts K whatever L* is
    (acceptance runs in stretches) and takes no turn in a running trial."""
    block = _block(trial_rounds=2)
    _run(block, 1500, 1, PROSE, _kink_round, jitter=0.05)
    b = block.buckets[1]
    assert b.length == 5
    before = (b.other, b.turn)
    assert block.next_length(1, after_full_accept=True) == K
    assert (b.other, b.turn) == before and b.extended == 1
    assert block.next_length(1) in (5, 4, 6, K)


def test_position_survival_can_pass_over_rounds():
    s = PositionSurvival(2, per_round=1.0)
    s.update([0, 0], [0, 0])
    s.update([10, 10], [5, 1])
    s.skip([20, 20], [20, 20])  # ten fully accepted rounds: not weighed
    s.update([30, 30], [25, 21])
    assert s.survival() == pytest.approx([0.5, 0.1])


def test_scripted_lengths_take_the_proposers_arguments():
    from adaflash_vllm.proposers.block_length import ScriptedBlockLength

    block = ScriptedBlockLength(3)
    got = [block.next_length(2, after_full_accept=True) for _ in range(4)]
    assert got == [1, 2, 3, 1]
    block.record_round(length=1, num_reqs=2, round_ms=1.0, survival=None)


def _geometric(rho: float, b: int, length: int = K) -> list[list[float]]:
    return [[rho**j for j in range(1, length + 1)]] * b


def _record(
    block, b, budgets, survival, *, length=K, rate=1.0, verify=0.2, draft=4.0, **kw
):
    """A chosen step whose round runs at `rate` tokens per ms."""
    s = [row[:length] for row in survival]
    tokens = b + sum(
        sum(row[: min(k, length)]) for row, k in zip(s, budgets, strict=True)
    )
    block.record_budgets(
        b,
        budgets,
        s,
        length=length,
        round_ms=tokens / rate,
        verify_ms_per_token=verify,
        draft_ms=draft,
        **kw,
    )


def test_chosen_budgets_cap_the_buckets_next_blocks():
    """16 requests under load (1.5 tokens per ms, a verified token 0.2 ms, a
    drafting slot 8 / 128 ms): the second position still pays (0.49 tokens
    per request for 0.0625 + 0.2 ms, 1.5 x 0.2625 = 0.39), the third (0.34)
    does not."""
    block = _block()
    assert block.next_length(16) == K  # no budgets seen yet
    _record(block, 16, [3] * 16, _geometric(0.7, 16), rate=1.5, draft=8.0)
    assert block.buckets[16].cap == 2
    assert block.next_length(16) == 2
    assert block.next_length(8) == K  # another bucket: its own cap
    assert block.buckets[16].capped == 1


def test_the_cap_follows_positions_over_steps_at_one_request():
    """At one request a step's survivals are one text's moment: one hard
    step (every position below the bar) does not cut a block whose positions
    paid over the steps before."""
    block = _block()
    easy, hard = _geometric(0.9, 1), _geometric(0.05, 1)
    for _ in range(40):
        _record(block, 1, [K], easy, rate=0.3, verify=0.05, draft=2.4)
    assert block.buckets[1].cap == K
    _record(block, 1, [K], hard, rate=0.3, verify=0.05, draft=2.4)
    assert block.buckets[1].cap == K
    for _ in range(200):
        _record(block, 1, [K], hard, rate=0.3, verify=0.05, draft=2.4)
    assert block.buckets[1].cap == 1


def test_a_block_whose_every_position_pays_grows_by_one():
    """One request, verification nearly free: every position pays, so the cap
    is one past the block (up to K)."""
    block = _block()
    _record(block, 1, [3], _geometric(0.9, 1, 3), length=3, rate=0.3, verify=0.01)
    assert block.buckets[1].cap == 4
    _record(block, 1, [K], _geometric(0.9, 1), rate=0.3, verify=0.01)
    assert block.buckets[1].cap == K


def test_positions_few_budgets_verify_are_cut():
    """Only two of 16 requests verify past the first draft: their second slots'
    1.28 tokens do not pay for drafting the position for all 16 (16 x 16 / 128
    ms) and verifying two (2 x 0.2 ms) at 0.6 tokens per ms (1.44)."""
    block = _block()
    s = _geometric(0.8, 16)
    _record(block, 16, [1] * 14 + [K, K], s, rate=0.6, verify=0.2, draft=16.0)
    assert block.buckets[16].cap == 1
    _record(block, 16, [0] * 16, s, rate=0.6, draft=8.0)  # nothing verified
    assert block.buckets[16].cap == 1


def test_draft_slot_cost_learns_the_slope_once_sizes_spread():
    from adaflash_vllm.proposers.block_length import DraftSlotCost

    cost = DraftSlotCost()
    # 2 ms fixed + 0.05 ms per slot; the first sizes alike: the whole per slot
    assert cost.observe(128, 8.4) == pytest.approx(8.4 / 128)
    assert cost.observe(128, 8.4) == pytest.approx(8.4 / 128)
    for slots in (48, 128, 32, 64, 128, 48) * 5:
        got = cost.observe(slots, 2.0 + 0.05 * slots)
    assert got == pytest.approx(0.05, rel=1e-6)
    # a line steeper than the whole round per slot is bounded by it
    assert cost.per_slot(10, 0.1) == pytest.approx(0.01)


def test_a_capped_step_takes_no_turn_in_a_trial():
    """A trial pairs rounds of L* and L'; a step cut short by the cap is
    neither, so its round time is not paired."""
    block = _block(trial_rounds=2)
    assert block.next_length(4) == K  # the first trial starts: L* = 7, L' = 6
    b = block.buckets[4]
    assert b.other == K - 1 and b.pending == K
    _record(block, 4, [1, 1, 0, 1], _geometric(0.5, 4), rate=0.6, draft=4.0)
    assert b.cap == 1
    assert block.next_length(4) == 1
    assert b.pending is None and b.open_star is None
    block.record_round(length=1, num_reqs=4, round_ms=5.0, survival=PROSE)
    assert b.pairs == [] and b.open_star is None


def test_the_cap_can_be_turned_off():
    block = _block(capping=False)
    _record(block, 16, [1] * 16, _geometric(0.5, 16), rate=0.6, draft=8.0)
    assert block.next_length(16) == K


def test_the_cap_respects_k_min():
    block = _block(k_min=3)
    _record(block, 16, [0] * 16, _geometric(0.5, 16), rate=0.6, draft=8.0)
    assert block.next_length(16) == 3


def test_measured_survival_prices_the_positions():
    """Predicted survivals say every position pays; the S_j verification
    measured say the third and later bring little: cut after the second."""
    block = _block()
    measured = [0.6, 0.4, 0.05, 0.02, 0.01, 0.01, 0.0]
    _record(block, 16, [K] * 16, _geometric(0.9, 16), rate=0.6, draft=8.0)
    assert block.buckets[16].cap == K
    block = _block()
    _record(
        block, 16, [K] * 16, _geometric(0.9, 16), rate=0.6, draft=8.0, measured=measured
    )
    assert block.buckets[16].cap == 2
