"""RetiredContext: which requests stopped keeping the drafter's context, and which
KV cache blocks therefore hold holes a prefix-cache hit must not pass on."""

import pytest
from adaflash_vllm.proposers.retired_context import PrefixHoles, RetiredContext

BS = 4  # tokens per block


def test_retire_marks_requests_and_the_blocks_of_their_slots():
    rc = RetiredContext(BS)
    rc.retire(["a", "b"], [8, 9, 17, -1])  # blocks 2, 2, 4; -1 is padding
    assert rc.retired == {"a", "b"}
    assert rc.holey == {2, 4}
    rc.retire(["a"], [10])  # a again: counted once
    assert rc.retired_total == 2


def test_a_hit_on_a_block_with_holes_retires_the_new_request():
    rc = RetiredContext(BS)
    rc.retire(["old"], [8, 9])  # block 2
    # 8 cached tokens = blocks [7, 2] are hits; block 5 is fresh
    assert rc.admit("follow_up", [7, 2, 5], num_cached=8)
    assert "follow_up" in rc.retired and rc.retired_on_hit == 1


def test_a_hit_on_clean_blocks_or_a_miss_does_not_retire():
    rc = RetiredContext(BS)
    rc.retire(["old"], [8])  # block 2
    assert not rc.admit("clean_hit", [7, 6, 5], num_cached=8)
    # block 2 given afresh (uncached: beyond the 4 cached tokens): holes gone
    assert not rc.admit("miss", [7, 2], num_cached=4)
    assert rc.holey == set()
    assert rc.retired == {"old"} and rc.retired_on_hit == 0


def test_a_partly_cached_block_is_not_a_hit():
    """Only whole blocks come from the prefix cache: 7 cached tokens with
    4-token blocks is one hit block; the second is recomputed (fresh)."""
    rc = RetiredContext(BS)
    rc.retire(["old"], [12])  # block 3
    assert not rc.admit("new", [1, 3], num_cached=7)
    assert 3 not in rc.holey


def test_blocks_appended_to_a_running_request_are_fresh():
    rc = RetiredContext(BS)
    rc.retire(["a"], [4, 20])  # blocks 1 and 5
    rc.fresh([5])  # freed, then appended to another request
    assert rc.holey == {1}
    rc.fresh([9])  # never had holes
    assert rc.holey == {1}


def test_forget_finished_is_amortised_and_keeps_live_ids():
    rc = RetiredContext(BS)
    rc.retire([f"r{i}" for i in range(20)], [])
    rc.forget_finished(["r0", "r1", "r2", "r3", "r4", "r5", "r6"])  # 20 <= 2*7+8
    assert len(rc.retired) == 20
    rc.forget_finished(["r0", "r1"])  # 20 > 2*2+8: trimmed to the live ones
    assert rc.retired == {"r0", "r1"}
    assert rc.retired_total == 20  # the counter is cumulative


def test_unretire_lets_requests_draft_again_and_keeps_the_holes():
    rc = RetiredContext(BS)
    rc.retire(["a", "b"], [8, 9])  # block 2
    assert rc.unretire(["a", "c"]) == 1  # c was never retired
    assert rc.retired == {"b"} and rc.unretired_total == 1
    assert rc.holey == {2}  # its slots were never written: still holes
    assert rc.admit("follow_up", [2, 5], num_cached=BS)  # a hit on them retires
    assert rc.unretire(["a"]) == 0 and rc.unretired_total == 1


def test_no_holes_means_admit_changes_nothing():
    rc = RetiredContext(BS)
    assert not rc.admit("a", [1, 2, 3], num_cached=8)
    assert rc.to_dict() == {
        "block_size": BS,
        "retired_now": 0,
        "retired_total": 0,
        "retired_on_hit": 0,
        "unretired_total": 0,
        "holey_blocks": 0,
        "upkeep_kept_tokens": 0,
        "upkeep_dropped_tokens": 0,
    }


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        RetiredContext(0)


def test_changes_reach_the_scheduler_once_and_net():
    """`take_changes` gives the blocks that got holes and those that lost them
    since the last call; a block that got and lost them in between is in
    neither net set's wrong side."""
    rc = RetiredContext(BS)
    rc.retire(["a"], [4, 20])  # blocks 1 and 5
    assert rc.take_changes() == ({1, 5}, set())
    assert rc.take_changes() == (set(), set())
    rc.fresh([5])
    rc.retire(["b"], [36])  # block 9
    rc.retire(["c"], [21])  # block 5 again
    assert rc.take_changes() == ({9, 5}, set())
    rc.admit("d", [1, 9], num_cached=0)  # both given afresh
    assert rc.take_changes() == (set(), {1, 9})
    assert rc.holey == {5}


def test_prefix_holes_mirror_the_worker_and_cut_only_while_not_retiring():
    holes = PrefixHoles([BS])
    rc = RetiredContext(BS)
    rc.retire(["a"], [8, 12])  # blocks 2 and 3
    holes.update(True, 0, *rc.take_changes(), cut=True)
    assert holes.blocks == {2, 3}
    assert holes.first_hole([7, 2, 3]) is None  # retiring: the hit retires
    holes.update(False, 0, frozenset(), frozenset(), cut=True)
    assert holes.first_hole([7, 2, 3]) == 1
    assert holes.first_hole([7, 6]) is None  # a hit without holes stays whole
    rc.fresh([2])
    holes.update(False, 0, *rc.take_changes(), cut=True)
    assert holes.blocks == {3}
    assert holes.first_hole([7, 2, 3]) == 2


def test_prefix_holes_keep_every_hit_unless_cuts_are_on():
    """`length.cut_holey_prefix_hits` off (the default): the blocks are still
    mirrored, but no hit is cut, retiring or not."""
    holes = PrefixHoles([BS])
    holes.update(False, 0, frozenset({2, 3}), frozenset())
    assert holes.blocks == {2, 3} and not holes.cutting
    assert holes.first_hole([7, 2, 3]) is None
    holes.update(False, 0, frozenset(), frozenset(), cut=True)  # turned on
    assert holes.first_hole([7, 2, 3]) == 1
    holes.update(False, 0, frozenset(), frozenset(), cut=False)  # and off
    assert holes.first_hole([7, 2, 3]) is None


def test_prefix_holes_align_cuts_to_every_group():
    holes = PrefixHoles([16, None, 32])
    assert holes.align == 32 and holes.block_size == 16
    holes.update(False, 2, frozenset(), frozenset())
    assert holes.gid == 2 and holes.block_size == 32
    with pytest.raises(ValueError, match="prefix-cached group"):
        PrefixHoles([None])
