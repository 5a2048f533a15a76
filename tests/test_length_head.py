"""The length head: trained on tiny models it predicts realised acceptance better
than a constant, its survival loss is the exact likelihood of the accepted length,
and it round-trips through the checkpoint format."""

import json
import math

import pytest
import torch
from adaflash_vllm.proposers.length_head import (
    CONFIG_KEY,
    HISTORY_KEY,
    KIND_KEY,
    LengthHead,
    calibration,
    draft_confidence,
    load_length_head,
)
from adaflash_vllm.training.checkpoint import (
    HEAD_FILE,
    INDEX_FILE,
    load_drafter,
    save_drafter,
)
from adaflash_vllm.training.drafter import DFlashDrafter
from adaflash_vllm.training.features import TargetModel
from adaflash_vllm.training.head import (
    budget_recall,
    evaluate_length_head,
    expected_median_error,
    head_loss,
    median_ratio,
    survival_nll,
    train_length_head,
)

K = 3  # the tiny drafter's drafts per block


def _with_head(tiny, kind: str | None) -> DFlashDrafter:
    """kind: "survival", "ratio", "history" (survival reading the previous
    round) or None (a checkpoint from before length_head_kind)."""
    cfg, state = load_drafter(tiny.drafter_trained)
    cfg["dflash_config"][CONFIG_KEY] = 32
    if kind == "history":
        kind = "survival"
        cfg["dflash_config"][HISTORY_KEY] = True
    if kind is not None:
        cfg["dflash_config"][KIND_KEY] = kind
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, strict=False)  # the head starts fresh
    return drafter


@pytest.fixture(scope="module", params=["survival", "ratio", "history"])
def drafter_with_head(request, tiny):
    drafter = _with_head(tiny, request.param)
    target = TargetModel(tiny.target)
    torch.set_num_threads(1)
    train, held_out = tiny.sequences[:48], tiny.sequences[48:]
    train_length_head(
        drafter.length_head, drafter, target, train, num_drafts=K, epochs=8, lr=3e-3
    )
    return drafter, target, held_out


def test_head_beats_constant_predictor_on_held_out_rounds(drafter_with_head):
    """The head's mean forecast has a lower MAE than the held-out mean itself; its
    median forecast is no worse than the best constant (the held-out median: on
    the tiny models both can be the same all-or-nothing length)."""
    drafter, target, held_out = drafter_with_head
    cal = evaluate_length_head(
        drafter.length_head, drafter, target, held_out, num_drafts=K
    )
    assert cal["n"] > 100
    assert cal["mae_mean"] < cal["mae_constant_mean"], cal
    if drafter.length_head.kind == "survival":
        assert cal["mae"] <= cal["mae_constant"], cal
        assert 0 <= cal["mae_expected"] <= 1, cal
        assert 0 <= cal["served"]["mae_expected"] <= 1, cal
    else:
        assert cal["mae"] == cal["mae_mean"], cal
        assert "mae_expected" not in cal, cal
    assert cal["mae_constant"] <= cal["mae_constant_mean"] + 1e-6, cal
    assert 0 <= cal["ece"] <= 1
    assert set(cal["budget_recall"]) == {"0.15", "0.3", "0.5"}
    assert all(0 < v <= 1 for v in cal["budget_recall"].values())
    # The rounds serving drafts (one served chain per sequence): fewer, the
    # same measures. A head with history, trained on such chains and reading
    # the previous round there, beats the constants on them too (the heads
    # trained at every position do not, on these tiny models).
    served = cal["served"]
    assert 20 < served["n"] < cal["n"], served
    if drafter.length_head.history:
        assert served["mae_mean"] < served["mae_constant_mean"], served
        assert served["mae"] <= served["mae_constant"] + 1e-6, served


def test_head_round_trips_through_the_checkpoint(drafter_with_head, tmp_path):
    """Head weights go to length_head.safetensors, hidden from stock vLLM by the
    weight index; loading gives the same kind and the same predictions."""
    drafter, _, _ = drafter_with_head
    out = save_drafter(tmp_path / "d", drafter.cfg, drafter.state_dict())
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert (out / HEAD_FILE).exists()
    assert not any(k.startswith("length_head.") for k in index)
    assert set(index.values()) == {"model.safetensors"}
    head = load_length_head(out)
    assert head.kind == drafter.length_head.kind
    assert head.history == drafter.length_head.history
    x = torch.randn(5, K, drafter.cfg["hidden_size"])
    conf = draft_confidence(torch.randn(5, K, 40))
    assert torch.allclose(head(x, conf), drafter.length_head(x, conf))
    if head.history:
        prev = torch.tensor([[1.0, 1.0, 1.0]] * 5)
        assert torch.allclose(head(x, conf, prev), drafter.length_head(x, conf, prev))
    cfg, state = load_drafter(out)
    reloaded = DFlashDrafter(cfg)
    reloaded.load_state_dict(state)  # strict: drafter + head keys both present


def test_checkpoint_without_a_kind_holds_a_ratio_head(tiny):
    """Heads saved before `length_head_kind` existed still load, as ratio heads."""
    drafter = _with_head(tiny, None)
    assert drafter.length_head.kind == "ratio"
    assert not drafter.length_head.needs_confidence


@pytest.mark.parametrize("kind", ["survival", "ratio", "history"])
def test_head_that_does_not_fit_is_rejected(tmp_path, tiny, kind):
    drafter = _with_head(tiny, kind)
    state = dict(drafter.state_dict())
    small = LengthHead(16, 32, num_drafts=K, kind=kind.replace("history", "survival"))
    state.update({f"length_head.{k}": v for k, v in small.state_dict().items()})
    out = save_drafter(tmp_path / "bad", drafter.cfg, state)
    with pytest.raises(ValueError, match="has shapes"):
        load_length_head(out)


def test_head_with_history_does_not_load_as_one_without(tmp_path, tiny):
    """A checkpoint whose config lost `length_head_history` is refused, naming
    the key (its head's first layer reads 3 more inputs)."""
    drafter = _with_head(tiny, "history")
    out = save_drafter(tmp_path / "h", drafter.cfg, drafter.state_dict())
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"][HISTORY_KEY]
    with pytest.raises(ValueError, match="length_head_history=false"):
        load_length_head(out, cfg)
    cfg["dflash_config"][HISTORY_KEY] = "yes"
    with pytest.raises(ValueError, match="true or false"):
        load_length_head(out, cfg)


def test_survival_head_refuses_another_k():
    head = LengthHead(8, 4, num_drafts=K)
    with pytest.raises(ValueError, match="K=3"):
        head.survival(torch.randn(2, 5, 8), torch.randn(2, 5, 3))


def _reference_confidence(logits):
    """The features' definition, term by term."""
    logp = logits.log_softmax(-1)
    p = logp.exp()
    top2 = logits.topk(2, -1).values if logits.shape[-1] > 1 else None
    margin = top2[:, 0] - top2[:, 1] if top2 is not None else torch.zeros(len(p))
    entropy = -(p * logp.nan_to_num(0.0, neginf=0.0)).sum(-1)
    return logp.max(-1).values, margin.clamp(0.0, 30.0), entropy


@pytest.mark.parametrize("block_search", [True, False])
@pytest.mark.parametrize("vocab", [1, 3, 30, 64, 65, 130, 4096, 4100])
def test_draft_confidence_matches_its_definition(vocab, block_search, monkeypatch):
    """(log p_top1, top1 - top2 logit, entropy) for vocabularies that fill the
    top-2 search's column blocks, leave a tail or fit none, with -inf logits
    and tied tops handled; through the block search (forced at this size) and
    through torch's topk (what 6 rows get by default)."""
    from adaflash_vllm.proposers import row_max

    if block_search:
        monkeypatch.setattr(row_max, "MIN_ELEMENTS", 0)
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab) * 3
    logits[0, 2:] = float("-inf")
    logits[1, -1] = logits[1].max()  # the top tied, far apart
    logits[2] = 1.0  # uniform: every token tied
    conf = draft_confidence(logits)
    logp, margin, entropy = _reference_confidence(logits)
    assert torch.allclose(conf[:, 0], logp, atol=1e-5)
    assert torch.allclose(conf[:, 1], margin, atol=1e-5)
    assert torch.allclose(conf[:, 2], entropy, atol=1e-4)
    if vocab > 1:
        assert conf[1, 1] == 0 and conf[2, 1] == 0
    assert torch.isfinite(conf).all()


@pytest.mark.parametrize(
    "accepted, valid, want",
    [
        # g = (0.9, 0.5, 0.2): P(a) = g1..ga * (1 - g_{a+1}) when a < n
        (0, 3, 0.1),
        (1, 3, 0.9 * 0.5),
        (2, 3, 0.9 * 0.5 * 0.8),
        (3, 3, 0.9 * 0.5 * 0.2),
        # cut short by the sequence end (n = 2): a = n is censored, not refused
        (2, 2, 0.9 * 0.5),
    ],
)
def test_survival_nll_is_the_likelihood_of_the_accepted_length(accepted, valid, want):
    g = torch.tensor([0.9, 0.5, 0.2])
    logits = torch.log(g / (1 - g)).view(1, 1, 3)
    nll = survival_nll(logits, torch.tensor([[accepted]]), torch.tensor([[valid]]))
    assert nll.item() == pytest.approx(-math.log(want), rel=1e-5)


def test_full_length_probabilities_sum_to_one():
    """Over a = 0..K the likelihoods form a distribution (no mass lost)."""
    logits = torch.randn(1, 1, K)
    total = sum(
        torch.exp(
            -survival_nll(logits, torch.tensor([[a]]), torch.tensor([[K]]))
        ).item()
        for a in range(K + 1)
    )
    assert total == pytest.approx(1.0, rel=1e-5)


def test_budget_recall_is_one_for_the_oracle_and_lower_for_a_bad_ranking():
    """The oracle's own survivals spend a budget perfectly; a ranking that puts
    the blocks that accept nothing first does worse."""
    torch.manual_seed(0)
    accepted = torch.randint(0, K + 1, (64,))
    oracle = (torch.arange(K) < accepted.unsqueeze(-1)).float()
    assert all(
        v == pytest.approx(1.0)
        for v in budget_recall(oracle, accepted, group=8).values()
    )
    inverted = 1.0 - oracle
    recall = budget_recall(inverted, accepted, group=8, fractions=(0.3,))
    assert recall["0.3"] < 0.7


def test_draft_confidence_in_chunks_equals_one_pass(monkeypatch):
    """Chunking rows (to bound temporaries for a large vocabulary) changes
    nothing."""
    import adaflash_vllm.proposers.length_head as lh

    logits = torch.randn(2, 7, 50)
    whole = draft_confidence(logits)
    monkeypatch.setitem(lh._CHUNK_ELEMENTS, "cpu", 3 * 50)  # 3 rows a chunk
    assert torch.equal(draft_confidence(logits), whole)
    assert whole.shape == (2, 7, 3)


def test_median_ratio_counts_the_slots_that_survive_with_even_odds():
    """Median length = slots with P(at least j accepted) >= 1/2, within the valid
    slots, as a fraction of them."""
    s = torch.tensor(
        [[[0.9, 0.6, 0.5, 0.2], [0.4, 0.3, 0.1, 0.0], [1.0, 1.0, 0.9, 0.8]]]
    )
    valid = torch.tensor([[4, 4, 2]])
    got = median_ratio(s, valid)
    assert torch.allclose(got, torch.tensor([[3 / 4, 0.0, 1.0]]))


def test_expected_median_error_is_what_the_forecast_distribution_expects():
    """E|A - median| / n under the predicted distribution: an all-or-nothing block
    accepted 80% of the time expects 0.2 (as calibration's example realises);
    a certain length expects 0; two valid slots of four with P(A >= 1) 0.9,
    P(A >= 2) 0.6: median 2, E = 0.1 * 2 + 0.3 * 1 = 0.5 over 2 slots."""
    s = torch.tensor(
        [[[0.8, 0.8, 0.8, 0.8], [1.0, 1.0, 0.0, 0.0], [0.9, 0.6, 0.55, 0.5]]]
    )
    valid = torch.tensor([[4, 4, 2]])
    got = expected_median_error(s, valid)
    assert torch.allclose(got, torch.tensor([[0.2, 0.0, 0.25]]))
    # a random survival curve, against lengths sampled from it slot by slot
    gen = torch.Generator().manual_seed(0)
    g = torch.rand(4, generator=gen)  # P(slot accepted | the ones before were)
    curve = g.cumprod(0).view(1, 1, 4)
    n = 200_000
    alive = torch.ones(n, dtype=torch.bool)
    a = torch.zeros(n)
    for j in range(4):
        alive &= torch.rand(n, generator=gen) < g[j]
        a += alive.float()
    m = median_ratio(curve, torch.tensor([[4]])).item() * 4
    sampled = (a - m).abs().mean().item() / 4
    want = expected_median_error(curve, torch.tensor([[4]])).item()
    assert sampled == pytest.approx(want, abs=0.005)


def test_calibration_scores_the_median_under_absolute_error():
    """On all-or-nothing blocks accepted 80% of the time, the median forecast (1)
    has MAE 0.2 and the mean forecast (0.8) 0.32; the best constant is the
    realised median, not the mean."""
    real = torch.tensor([1.0] * 8 + [0.0] * 2)
    mean = torch.full((10,), 0.8)
    cal = calibration(mean, real, median=torch.ones(10))
    assert cal["mae"] == pytest.approx(0.2)
    assert cal["mae_mean"] == pytest.approx(0.32)
    assert cal["mae_constant"] == pytest.approx(0.2)
    assert cal["mae_constant_mean"] == pytest.approx(0.32)
    assert calibration(mean, real)["mae"] == pytest.approx(0.32)  # no median given


def test_head_loss_scores_the_median_forecast_on_the_blocks_asked_for():
    """The absolute error head_loss reports (the online trainer's served MAE)
    is the median forecast's against the accepted fraction, over the valid
    blocks of `scored` only."""
    torch.manual_seed(0)
    head = LengthHead(8, 4, num_drafts=K)
    hidden, confidence = torch.randn(2, 3, K, 8), torch.randn(2, 3, K, 3)
    accepted = torch.tensor([[0, 3, 1], [2, 0, 3]])
    valid = torch.tensor([[3, 3, 3], [3, 2, 3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # [0, 2] invalid
    scored = torch.tensor([[True, False, True], [True, True, False]])
    out = head_loss(head, hidden, confidence, accepted, valid, mask, scored=scored)
    with torch.no_grad():
        s = torch.sigmoid(head.logits(hidden, confidence)).cumprod(-1)
    err = (median_ratio(s, valid) - accepted / valid).abs()
    assert out.scored == 3  # [0, 0], [1, 0], [1, 1]
    assert out.abs_error == pytest.approx(float(err[0, 0] + err[1, 0] + err[1, 1]))
    everything = head_loss(head, hidden, confidence, accepted, valid, mask)
    assert everything.scored == 5
    assert everything.abs_error == pytest.approx(float((err * mask).sum()))
    out.loss.backward()
    assert all(p.grad is not None for p in head.parameters())
