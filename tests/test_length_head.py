"""The length head: trained on tiny models it predicts realised acceptance better
than a constant, and it round-trips through the checkpoint format."""

import json

import pytest
import torch
from adaflash_vllm.proposers.length_head import CONFIG_KEY, LengthHead, load_length_head
from adaflash_vllm.training.checkpoint import (
    HEAD_FILE,
    INDEX_FILE,
    load_drafter,
    save_drafter,
)
from adaflash_vllm.training.drafter import DFlashDrafter
from adaflash_vllm.training.features import TargetModel
from adaflash_vllm.training.head import evaluate_length_head, train_length_head


@pytest.fixture(scope="module")
def drafter_with_head(tiny):
    cfg, state = load_drafter(tiny.drafter_trained)
    cfg["dflash_config"][CONFIG_KEY] = 32
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, strict=False)  # the head starts fresh
    target = TargetModel(tiny.target)
    torch.set_num_threads(1)
    train, held_out = tiny.sequences[:48], tiny.sequences[48:]
    train_length_head(
        drafter.length_head, drafter, target, train, num_drafts=3, epochs=8, lr=3e-3
    )
    return drafter, target, held_out


def test_head_beats_constant_predictor_on_held_out_rounds(drafter_with_head):
    """MAE of the head < MAE of the best constant (the held-out mean itself)."""
    drafter, target, held_out = drafter_with_head
    cal = evaluate_length_head(
        drafter.length_head, drafter, target, held_out, num_drafts=3
    )
    assert cal["n"] > 100
    assert cal["mae"] < cal["mae_constant"], cal
    assert 0 <= cal["ece"] <= 1


def test_head_round_trips_through_the_checkpoint(drafter_with_head, tmp_path):
    """Head weights go to length_head.safetensors, hidden from stock vLLM by the
    weight index; loading gives the same predictions."""
    drafter, _, _ = drafter_with_head
    out = save_drafter(tmp_path / "d", drafter.cfg, drafter.state_dict())
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert (out / HEAD_FILE).exists()
    assert not any(k.startswith("length_head.") for k in index)
    assert set(index.values()) == {"model.safetensors"}
    head = load_length_head(out)
    x = torch.randn(5, 3, drafter.cfg["hidden_size"])
    assert torch.allclose(head(x), drafter.length_head(x))
    cfg, state = load_drafter(out)
    reloaded = DFlashDrafter(cfg)
    reloaded.load_state_dict(state)  # strict: drafter + head keys both present


def test_head_that_does_not_fit_is_rejected(tmp_path, drafter_with_head):
    drafter, _, _ = drafter_with_head
    cfg = dict(drafter.cfg)
    state = dict(drafter.state_dict())
    small = LengthHead(16, 32)
    state.update({f"length_head.{k}": v for k, v in small.state_dict().items()})
    out = save_drafter(tmp_path / "bad", cfg, state)
    with pytest.raises(ValueError, match="expects input 32"):
        load_length_head(out)
