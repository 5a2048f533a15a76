"""Offline drafter training (the DFlash recipe) on tiny models: it learns, it
resumes, and a resume point from another configuration is refused."""

import pytest
import torch
from adaflash_vllm.training.blocks import greedy_tau
from adaflash_vllm.training.data import Sequence
from adaflash_vllm.training.features import TargetModel
from adaflash_vllm.training.offline import (
    OfflineTrainConfig,
    OfflineTrainer,
    load_or_init_drafter,
)

from adaflash_vllm.errors import AdaFlashConfigError


def test_short_run_lowers_loss_and_raises_tau(tiny):
    """The session's tiny drafter: loss fell, and tau on its training prompts beats
    the same drafter at random init."""
    first = sum(tiny.train_losses[:10]) / 10
    last = sum(tiny.train_losses[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    assert tiny.trained_tau > tiny.random_tau + 0.05, (
        tiny.random_tau,
        tiny.trained_tau,
    )


def test_greedy_tau_walks_rounds_like_verification():
    """Rounds advance by accepted + 1; tau = emitted / rounds."""
    seq = Sequence(list(range(12)), prompt_len=2)
    # anchors 2..10: accept 3 at anchor 2, 0 at 6, 2 at 7, then up to the end
    tau_rounds = greedy_tau({2: 3, 6: 0, 7: 2, 10: 5}, seq)
    assert tau_rounds == (4, 9)  # 2->6 (4), 6->7 (1), 7->10 (3), 10->11 (1)


def _trainer(tiny, out, **kw) -> OfflineTrainer:
    import json

    cfg = json.loads((tiny.drafter_random / "config.json").read_text())
    options = dict(block_size=4, epochs=2, batch_size=4, num_anchors=8, save_every=2)
    options.update(kw)
    return OfflineTrainer(
        TargetModel(tiny.target),
        load_or_init_drafter(None, cfg),
        OfflineTrainConfig(**options),
        out,
    )


def test_interrupted_training_resumes_from_the_last_checkpoint(tiny, tmp_path):
    torch.set_num_threads(1)
    seqs = tiny.sequences[:16]
    trainer = _trainer(tiny, tmp_path)
    total = 8  # 16 sequences / batch 4 * 2 epochs
    for _ in range(5):  # "interrupted" after step 5; the resume point is step 4
        trainer.train_step(seqs[:4], total)
        if trainer.state.step % 2 == 0:
            trainer.save_resume_point(total)
    resumed = _trainer(tiny, tmp_path)
    state = resumed.train(seqs)
    assert state.step == total  # resumed at step 4, not from scratch
    assert len(state.losses) == total - 4


def test_resume_from_other_config_is_refused(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path)
    trainer.save_resume_point(8)
    with pytest.raises(AdaFlashConfigError, match="another drafter or training"):
        _trainer(tiny, tmp_path, lr=1e-2).train(tiny.sequences[:8])


def test_head_only_training_keeps_the_drafter_and_adds_a_survival_head(tiny, tmp_path):
    """`train-drafter --init D --head-only`: the drafter's own tensors are
    unchanged, the checkpoint gains a survival head with its calibration (how a
    z-lab drafter, shipped without a head, gets one)."""
    import argparse
    import json

    from adaflash_vllm.proposers.length_head import load_length_head
    from adaflash_vllm.training.checkpoint import load_drafter
    from adaflash_vllm.training.data import save_sequences
    from adaflash_vllm.training.train_drafter import (
        add_train_drafter_args,
        main_train_drafter,
    )

    torch.set_num_threads(1)
    seqs = tiny.sequences[:24]
    out = tmp_path / "head"
    save_sequences(out / "sequences.jsonl", seqs)  # no regeneration through vLLM
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(len(seqs)))
    )
    parser = argparse.ArgumentParser()
    add_train_drafter_args(parser)
    args = parser.parse_args(
        f"--target {tiny.target} --prompts {prompts} --out {out} "
        f"--init {tiny.drafter_trained} --head-only --length-head 16 "
        "--head-epochs 2".split()
    )
    metrics = main_train_drafter(args)
    _, before = load_drafter(tiny.drafter_trained)
    _, after = load_drafter(out / "drafter")
    assert all(torch.equal(after[k], v) for k, v in before.items())
    head = load_length_head(out / "drafter")
    assert head.kind == "survival" and head.bottleneck == 16
    assert metrics["head_only"] and metrics["steps"] == 0
    assert metrics["length_head_calibration"]["n"] > 0


def test_head_only_needs_a_drafter_and_a_head_size(tiny, tmp_path):
    import argparse

    from adaflash_vllm.training.train_drafter import (
        add_train_drafter_args,
        main_train_drafter,
    )

    parser = argparse.ArgumentParser()
    add_train_drafter_args(parser)
    args = parser.parse_args(
        f"--target {tiny.target} --prompts x.jsonl --out {tmp_path} --head-only".split()
    )
    with pytest.raises(AdaFlashConfigError, match="--head-only"):
        main_train_drafter(args)
