"""The length head's history input: the previous round's features, the served
chains it trains and is scored on, the trainer's logged rounds, the proposer's
per-request rows, and that a head learns from them what the block alone does not
show."""

from types import SimpleNamespace

import pytest
import torch
from adaflash_vllm.proposers.length_head import LengthHead, round_history
from adaflash_vllm.proposers.proposer import AdaFlashProposer, _Propose
from adaflash_vllm.training.head import served_chains, survival_nll
from adaflash_vllm.training.online import (
    OnlineTrainer,
    _forced_history,
    served_calibration,
    served_calibration_sums,
)

from adaflash_vllm.buffer import Trajectory
from tests.helpers import served_trajectories, trainer_config

K = 4


def test_round_history_features():
    """(u, u a'/K, u [a' = k']): no round -> zeros; a' above k' is clamped."""
    h = round_history(torch.tensor([0, 2, 4, 3, 5]), torch.tensor([0, 4, 4, 3, 2]), K)
    want = [
        [0.0, 0.0, 0.0],  # no previous round
        [1.0, 0.5, 0.0],  # 2 of 4 accepted: a rejection
        [1.0, 1.0, 1.0],  # all of a full block
        [1.0, 0.75, 1.0],  # all of a budget of 3: a lower bound
        [1.0, 0.5, 1.0],  # 5 "accepted" of 2 verified: clamped
    ]
    assert h.tolist() == want


def test_served_chain_walks_rounds_like_verification():
    """Each round starts after the last one's accepted drafts and bonus token,
    and reads that round; the first reads none."""
    accepted = [2, 0, 0, 1, 0, 4, 0, 0, 0, 0, 3, 0]
    rounds = served_chains(accepted, K)
    assert rounds == [(0, 0, 0), (3, 2, K), (5, 1, K), (10, 4, K)]


def test_cut_chains_start_earlier_and_read_capped_counts():
    """Later chains cut rounds at random budgets: their rounds start at other
    offsets, and a budget-capped round shows a' = k' < K."""
    accepted = [K] * 40
    gen = torch.Generator().manual_seed(0)
    rounds = served_chains(accepted, K, chains=8, cut_share=0.5, generator=gen)
    full = served_chains(accepted, K)
    assert set(full) < set(rounds)
    assert len(set(rounds)) == len(rounds)  # each kept once
    assert any(0 < k < K and a == k for _, a, k in rounds)
    assert all(a <= k for _, a, k in rounds)
    assert all(0 <= i < len(accepted) for i, _, _ in rounds)


def test_trainer_reads_the_logged_round_before_each_block():
    """Logged rounds anchor at position - 1 and read the round before them (as
    (accepted, verified)); blocks not logged read none."""
    t = Trajectory(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4, 5, 6, 7, 8, 9, 10],
        round_positions=[3, 6, 7],
        round_drafts=[4, 3, 0],
        round_accepted=[2, 0, 0],
        drafter_version=0,
        temperature=0.0,
        finish_reason="length",
    )
    trainer = SimpleNamespace(cfg=SimpleNamespace(max_len=64))
    seqs, forced = OnlineTrainer._sequences(trainer, [t])
    assert forced == [{2: (0, 0), 5: (2, 4), 6: (0, 3)}]
    anchors = torch.tensor([[2, 4, 5, 6]])
    h = _forced_history(anchors, forced, K)
    assert h.tolist() == [
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.5, 0.0], [1.0, 0.0, 0.0]]
    ]


class _Sampler:
    def __init__(self, emitted):
        self.emitted = emitted

    def take_emitted(self):
        emitted, self.emitted = self.emitted, None
        return emitted


def _proposer(emitted):
    return SimpleNamespace(
        _runner=SimpleNamespace(rejection_sampler=_Sampler(emitted)),
        num_speculative_tokens=K,
    )


def _last(budgets, drafted=True):
    return _Propose(0.0, 0.0, frozenset(budgets), drafted, budgets=budgets)


def test_proposer_pairs_each_request_with_its_own_round():
    """Rows of this step's verification are the batch order (req_ids); the
    verified counts come from the last propose's budgets by request; a request
    that verified nothing (new, or budget 0) reads no round. Taken once."""
    me = _proposer(torch.tensor([3, 1, 1, 5]))  # emitted = accepted + 1
    last = _last({"a": 4, "b": 2, "c": 0, "d": 4})
    h = AdaFlashProposer._round_history(me, ["b", "a", "new", "d"], last)
    assert h.tolist() == [
        [1.0, 0.5, 1.0],  # b: 2 of 2
        [1.0, 0.0, 0.0],  # a: 0 of 4
        [0.0, 0.0, 0.0],  # new: no round
        [1.0, 1.0, 1.0],  # d: 4 of 4
    ]
    assert AdaFlashProposer._round_history(me, ["b", "a", "new", "d"], last) is None


@pytest.mark.parametrize(
    "emitted, last",
    [
        (None, _last({"a": 4})),  # no verification ran this step
        (torch.tensor([2]), _last({"a": 4}, drafted=False)),  # skipped step
        (torch.tensor([2]), None),  # first step
        (torch.tensor([2, 2]), _last({"a": 4})),  # rows that are not this batch
    ],
)
def test_proposer_reads_no_round_when_there_is_none(emitted, last):
    assert AdaFlashProposer._round_history(_proposer(emitted), ["a"], last) is None


def test_head_learns_what_the_previous_round_says():
    """Blocks whose acceptance follows the previous round, not their own
    features: a head with history fits them; one without cannot."""
    gen = torch.Generator().manual_seed(0)
    n, hidden = 4096, 8
    x = torch.randn(n, K, hidden, generator=gen)
    conf = torch.randn(n, K, 3, generator=gen)
    prev = torch.randint(0, K + 1, (n,), generator=gen)
    accepted = prev.clone()  # acceptance runs in stretches, exactly
    history = round_history(prev, torch.full((n,), K), K)
    valid = torch.full((n,), K)

    def fit(head, hist):
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        for _ in range(300):
            loss = survival_nll(head.logits(x, conf, hist), accepted, valid).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    torch.manual_seed(0)
    with_history = fit(LengthHead(hidden, 16, num_drafts=K, history=True), history)
    torch.manual_seed(0)
    without = fit(LengthHead(hidden, 16, num_drafts=K), None)
    assert with_history < 0.2 * without, (with_history, without)


def test_online_round_trains_a_head_with_history(tiny, tiny_head_drafter, tmp_path):
    """A round of the online trainer on logged rounds feeds their history to the
    head: the head's history inputs carry gradient, and it reports its error."""
    trajectories = served_trajectories(tiny, 4, drafts=3, accepted=2)
    # (no random anchors: the logged rounds only)
    cfg = trainer_config(tmp_path / "buf", tmp_path / "ver", batch_size=4)
    trainer = OnlineTrainer(
        cfg,
        target_path=tiny.target,
        drafter_path=str(tiny_head_drafter),
        num_drafts=3,
        device="cpu",
        push=False,
        rank=0,
        world_size=1,
    )
    try:
        head = trainer.drafter.length_head
        assert head.history
        metrics = trainer.train_round(trajectories)
        assert metrics.head_mse > 0
        # every block is a logged round (no random anchors), each scored
        # before the round's one optimizer step: a real error of a fresh head
        assert metrics.head_served_mae is not None
        assert 0 < metrics.head_served_mae < 1
        assert 0 <= metrics.head_served_ece <= 1
        assert metrics.head_served_mae_constant is None  # no round before
        again = trainer.train_round(trajectories)  # the last median: constant
        assert again.head_served_mae_constant is not None
        assert 0 <= again.head_served_mae_constant <= 1
        grad = head.proj.weight.grad
        assert grad is not None and grad[:, -3:].abs().sum() > 0  # history columns
    finally:
        trainer.close()


def test_served_calibration_sums_give_ece_and_the_next_constant():
    """The online trainer's calibration on logged rounds, from sums that add up
    over steps and ranks: ECE of the predicted mean over 10 bins, the MAE of
    the previous round's realised median as a constant forecast, and this
    round's realised median for the next."""
    mean = torch.tensor([0.05, 0.15, 0.95])
    real = torch.tensor([0.0, 0.2, 1.0])
    first = served_calibration_sums(mean[:2], real[:2], None)
    second = served_calibration_sums(mean[2:], real[2:], None)
    assert set(first) == set(second)  # the same keys on every step and rank
    sums = {k: first[k] + second[k] for k in first}
    sums.update(head_abs_error=0.3, head_scored=3.0)
    out, median = served_calibration(sums, None)
    assert out["head_served_mae"] == pytest.approx(0.1)
    assert out["head_served_ece"] == pytest.approx((0.05 + 0.05 + 0.05) / 3)
    assert out["head_served_mae_constant"] is None  # no round before
    assert median == pytest.approx(0.2)
    scored = served_calibration_sums(mean, real, 0.2)
    assert scored["const_abs_error"] == pytest.approx(0.2 + 0.0 + 0.8)
    sums = {**scored, "head_abs_error": 0.3, "head_scored": 3.0}
    out, median = served_calibration(sums, 0.2)
    assert out["head_served_mae_constant"] == pytest.approx(1.0 / 3)
    # a round that scored nothing keeps the last median and reports nothing
    assert served_calibration({"head_scored": 0.0}, 0.2) == ({}, 0.2)
