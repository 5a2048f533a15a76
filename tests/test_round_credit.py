"""Which rounds the draft gate is credited with (AdaFlashProposer._credit_round),
engine-free: the method reads only its arguments."""

from __future__ import annotations

from adaflash_vllm.proposers.proposer import AdaFlashProposer, _Propose


class _Gate:
    def __init__(self):
        self.rounds = []

    def record_round(self, **kw):
        self.rounds.append(kw)


def _credit(last_batch, batch, accepted=0, drafted=True, after_drafted=None):
    gate = _Gate()
    last = _Propose(10.0, 10.002, frozenset(last_batch), drafted, after_drafted)
    AdaFlashProposer._credit_round(None, gate, last, frozenset(batch), 10.05, accepted)
    return gate.rounds


def test_same_batch_is_credited_start_to_start():
    (r,) = _credit({"a", "b"}, {"a", "b"}, accepted=3)
    assert r["drafted"] is True and r["tokens"] == 5
    assert abs(r["ms"] - 50.0) < 1e-6


def test_finished_requests_still_credit_their_last_tokens():
    (r,) = _credit({"a", "b", "c"}, {"a"})
    assert r["tokens"] == 3


def test_a_new_request_prompt_is_not_credited():
    assert _credit({"a", "b"}, {"a", "b", "new"}) == []


def test_disjoint_or_empty_batches_are_not_credited():
    assert _credit({"a"}, {"b"}) == []
    assert _credit({"a"}, set()) == []


def test_the_first_round_after_a_switch_is_not_credited():
    """Its propose wrote the context of the other mode's round."""
    assert _credit({"a"}, {"a"}, drafted=False, after_drafted=True) == []
    assert _credit({"a"}, {"a"}, drafted=True, after_drafted=False) == []
    assert len(_credit({"a"}, {"a"}, drafted=False, after_drafted=False)) == 1
    assert len(_credit({"a"}, {"a"}, drafted=True, after_drafted=True)) == 1
