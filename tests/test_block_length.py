"""The drafter's block length per step (proposers/block_length.py), engine-free:
synthetic per-position survivals and round times, with a machine whose speed
swings."""

from __future__ import annotations

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
    _run(block, 1, 1, PROSE, _kink_round)  # starts a trial K vs K - 1
    b = block.buckets[1]
    block.record_round(length=3, num_reqs=1, round_ms=1.0, survival=PROSE)
    block.record_round(length=K, num_reqs=2, round_ms=1.0, survival=PROSE)
    assert b.times == {K: [8.6], K - 1: []}


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
