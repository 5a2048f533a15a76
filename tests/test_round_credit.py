"""Which rounds the draft gate is credited with, and for how long
(AdaFlashProposer._credit_round), engine-free: the method reads only its
arguments and the proposer's cost curve."""

from __future__ import annotations

import types

import pytest
from adaflash_vllm.proposers.cost_model import StepCostModel
from adaflash_vllm.proposers.proposer import AdaFlashProposer, _Propose


class _Gate:
    def __init__(self):
        self.rounds = []

    def record_round(self, **kw):
        self.rounds.append(kw)


def _credit(
    last_batch,
    batch,
    accepted=0,
    drafted=True,
    after_drafted=None,
    budgets=None,
    num_tokens=0,
    cost=None,
):
    gate = _Gate()
    last = _Propose(
        10.0, 10.002, frozenset(last_batch), drafted, after_drafted, budgets
    )
    proposer = types.SimpleNamespace(cost_model=cost)
    AdaFlashProposer._credit_round(
        proposer, gate, last, frozenset(batch), 10.05, accepted, num_tokens
    )
    return gate.rounds


def test_same_batch_is_credited_start_to_start():
    (r,) = _credit({"a", "b"}, {"a", "b"}, accepted=3)
    assert r["drafted"] is True and r["tokens"] == 5
    assert r["ms"] == pytest.approx(50.0)


def test_finished_requests_still_credit_their_last_tokens():
    (r,) = _credit({"a", "b", "c"}, {"a"})
    assert r["tokens"] == 3


def test_a_new_request_prompt_is_taken_out_with_the_cost_curve():
    """The step ran a's and b's 1 + k_i (2 + 4 tokens) and a new prompt (94): the
    prompt's share of the step, cost(100) - cost(6), is not the round's."""
    cost = StepCostModel([1, 128], [10.0, 35.4])  # 10 ms + 0.2 ms per extra token
    (r,) = _credit(
        {"a", "b"},
        {"a", "b", "new"},
        accepted=2,
        budgets={"a": 1, "b": 3},
        num_tokens=100,
        cost=cost,
    )
    assert r["tokens"] == 4
    assert r["ms"] == pytest.approx(50.0 - (cost(100) - cost(6)))


def test_without_a_cost_curve_rounds_with_new_requests_are_left_out():
    assert _credit({"a", "b"}, {"a", "b", "new"}, budgets={"a": 0}) == []
    # and so is a round the prompt's estimate would leave with no time at all
    cost = StepCostModel([1, 128], [1.0, 1000.0])
    assert (
        _credit({"a"}, {"a", "new"}, budgets={"a": 0}, num_tokens=128, cost=cost) == []
    )


def test_disjoint_or_empty_batches_are_not_credited():
    assert _credit({"a"}, {"b"}) == []
    assert _credit({"a"}, set()) == []


def test_the_first_round_after_a_switch_is_not_credited():
    """Its propose wrote the context of the other mode's round."""
    assert _credit({"a"}, {"a"}, drafted=False, after_drafted=True) == []
    assert _credit({"a"}, {"a"}, drafted=True, after_drafted=False) == []
    assert len(_credit({"a"}, {"a"}, drafted=False, after_drafted=False)) == 1
    assert len(_credit({"a"}, {"a"}, drafted=True, after_drafted=True)) == 1


def test_an_excluded_gap_leaves_the_round_and_the_step_cost():
    """exclude_gap (engines stepped in turn in one process): the 30 ms this engine
    sat idle come out of the round it credits (start to start) and out of the
    step cost measured from the last propose's end; nothing before a propose."""
    proposer = types.SimpleNamespace(_last_propose=None, _steady=None)
    AdaFlashProposer.exclude_gap(proposer, 0.03)
    assert proposer._last_propose is None
    proposer._last_propose = _Propose(10.0, 10.002, frozenset({"a"}), True)
    AdaFlashProposer.exclude_gap(proposer, 0.03)
    AdaFlashProposer.exclude_gap(proposer, -1.0)  # a clock step back: ignored
    last = proposer._last_propose
    assert (last.started, last.ended) == pytest.approx((10.03, 10.032))
    assert last.batch == frozenset({"a"}) and last.drafted is True
    gate = _Gate()
    AdaFlashProposer._credit_round(
        types.SimpleNamespace(cost_model=None), gate, last, last.batch, 10.08, 1, 2
    )
    assert gate.rounds[0]["ms"] == pytest.approx(50.0)


def _observed(last_batch, batch, num_tokens=2):
    """How many observations the cost curve took from one step (last propose
    ended at 10.002 s, this one started at 10.05 s)."""
    cost = StepCostModel([1, 128], [10.0, 35.4])
    proposer = types.SimpleNamespace(
        cost_model=cost,
        draft_gate=None,
        budget_policy=None,
        _accepted_total=0,
        _sampler_accepted=lambda: 0,
    )
    last = _Propose(10.0, 10.002, frozenset(last_batch), False)
    AdaFlashProposer._observe_step_cost(
        proposer, last, frozenset(batch), 10.05, num_tokens
    )
    return cost.observations, cost(num_tokens)


def test_the_cost_curve_learns_only_from_steps_of_the_same_requests():
    """A step after a request finished is left out (served, it also pays the
    API server's turnover: run 33), as is one with a new request or none."""
    observations, after = _observed({"a", "b"}, {"a", "b"})
    assert observations == 1 and after > StepCostModel([1, 128], [10.0, 35.4])(2)
    assert _observed({"a", "b", "c"}, {"a", "b"})[0] == 0  # c finished
    assert _observed({"a", "b"}, {"a", "b", "new"})[0] == 0
    assert _observed({"a"}, set())[0] == 0
