"""The drafter's block length per step (proposers/block_length.py), engine-free:
synthetic survivals, cost curves and drafting times."""

from __future__ import annotations

import pytest
import torch
from adaflash_vllm.proposers.block_length import BlockLength

K = 7


def _survival(b: int, p: float) -> torch.Tensor:
    """[b, K] geometric survivals p, p^2, ..."""
    return (p ** torch.arange(1, K + 1, dtype=torch.float32)).repeat(b, 1)


def _probe(block, s, cost, draft_ms, context_ms=0.0):
    block.probing = True  # as next_length() leaves it on a probe step
    block.observe(
        length=block.full,
        num_reqs=s.shape[0],
        draft_ms=draft_ms,
        survival=s,
        cost=cost,
        context_ms=context_ms,
    )


def test_flat_verification_and_cheap_drafting_keep_the_full_block():
    block = BlockLength(full=K)
    _probe(block, _survival(1, 0.9), cost=lambda n: 10.0, draft_ms=1.0)
    assert block.length == K


def test_steep_verification_and_costly_drafting_pick_a_short_block():
    block = BlockLength(full=K)
    # 32 requests; verifying costs 0.4 ms a token; the full block costs 16 ms.
    _probe(block, _survival(32, 0.7), cost=lambda n: 10.0 + 0.4 * n, draft_ms=16.0)
    assert 1 <= block.length <= 2
    rates = block.last_rates
    assert rates[block.length] > rates[K]


def test_shortest_block_wins_a_tie():
    # Nothing past slot 1 is ever accepted: every L >= 1 verifies the same budgets,
    # and drafting time grows with L, so L = 1.
    s = torch.zeros(4, K)
    s[:, 0] = 0.9
    block = BlockLength(full=K)
    _probe(block, s, cost=lambda n: 10.0 + 0.1 * n, draft_ms=8.0)
    assert block.length == 1


def test_probe_schedule_backs_off_while_the_choice_holds():
    block = BlockLength(full=K, min_interval=2, max_interval=8, ema=1.0)
    assert block.next_length() == K  # nothing chosen yet: probe
    steep = dict(cost=lambda n: 10.0 + 0.4 * n, draft_ms=16.0)
    _probe(block, _survival(32, 0.7), **steep)
    short = block.length
    assert short < K and block.interval == 2
    assert [block.next_length() for _ in range(3)] == [short, short, K]
    _probe(block, _survival(32, 0.7), **steep)  # same choice: back off
    assert block.interval == 4
    assert [block.next_length() for _ in range(5)] == [short] * 4 + [K]
    # Verification became flat: the probe picks the full block and resets.
    _probe(block, _survival(32, 0.7), cost=lambda n: 10.0, draft_ms=1.0)
    assert block.length == K and block.interval == 2


def test_short_blocks_measure_their_own_cost():
    block = BlockLength(full=K)
    # Only the full block measured: a line through context-only time at L = 0.
    block.observe(length=K, num_reqs=10, draft_ms=80.0, survival=None, cost=None)
    assert block.draft_ms(K, 10, context_ms=10.0) == pytest.approx(80.0)
    assert block.draft_ms(0, 10, context_ms=10.0) == pytest.approx(10.0)
    assert block.draft_ms(3, 10, context_ms=10.0) == pytest.approx(10 + 70 * 3 / 7)
    # A measured short block replaces that anchor (per request, any batch size).
    block.observe(length=1, num_reqs=20, draft_ms=60.0, survival=None, cost=None)
    assert block.draft_ms(1, 10, context_ms=10.0) == pytest.approx(30.0)
    assert block.draft_ms(4, 10, context_ms=10.0) == pytest.approx(30 + 50 * 3 / 6)
    # Non-probe steps (short blocks) never change the choice.
    assert block.length == 0 and block.probes == 0


def test_only_probes_choose_even_when_the_choice_is_the_full_block():
    block = BlockLength(full=K, min_interval=4)
    assert block.next_length() == K and block.probing
    _probe(block, _survival(1, 0.9), cost=lambda n: 10.0, draft_ms=1.0)
    assert block.length == K and block.probes == 1
    for _ in range(4):  # full-length steps, but not probes
        assert block.next_length() == K and not block.probing
        block.observe(
            length=K,
            num_reqs=1,
            draft_ms=1.0,
            survival=_survival(1, 0.1),
            cost=lambda n: 10.0 + n,
        )
    assert block.probes == 1
    assert block.next_length() == K and block.probing
