"""Which served trajectories a training round takes (no model, no engine)."""

from adaflash_vllm.training.online import newest_batch


def test_waits_for_a_full_round():
    batch, pending, passed = newest_batch([1, 2, 3], 4)
    assert batch is None and pending == [1, 2, 3] and passed == 0


def test_takes_the_newest_and_passes_over_a_backlog():
    """A trainer that fell behind (10 waiting, rounds of 4) learns from the
    newest 4: after a domain shift those are the new domain's."""
    batch, pending, passed = newest_batch(list(range(10)), 4)
    assert batch == [6, 7, 8, 9] and pending == [] and passed == 6


def test_exactly_one_round_waiting_passes_nothing_over():
    batch, pending, passed = newest_batch([1, 2, 3, 4], 4)
    assert batch == [1, 2, 3, 4] and pending == [] and passed == 0
