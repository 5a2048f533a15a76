"""Offline (from-scratch) DFlash drafter training on target-regenerated data.

The DFlash recipe: random anchors per sequence, K mask slots per block, CE on the
target's tokens with position-decay weights w_k = exp(-(k-1)/gamma), AdamW with
linear warmup then cosine decay, gradient clipping, bf16 autocast where the device
supports it. Checkpoints (drafter + optimizer + step) are written every
`save_every` steps so an interrupted run resumes losing at most that interval.

Run: `adaflash train-drafter --target T --prompts P.jsonl --out DIR` (see cli.py).

Shape symbols: B sequences, M anchors, K drafts per block, V vocabulary.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from adaflash_vllm.training.blocks import (
    accepted_lengths,
    block_labels,
    greedy_tau,
    make_batch,
    student_logits,
)
from adaflash_vllm.training.checkpoint import load_drafter, save_drafter
from adaflash_vllm.training.data import Sequence
from adaflash_vllm.training.drafter import DFlashDrafter
from adaflash_vllm.training.features import TargetModel
from adaflash_vllm.training.losses import position_decay_weights
from tqdm.auto import tqdm

from adaflash_vllm.errors import AdaFlashConfigError


@dataclass
class OfflineTrainConfig:
    """Options of `adaflash train-drafter` (the DFlash recipe's knobs)."""

    block_size: int = 8  # K = block_size - 1 drafts per block
    num_anchors: int = 32  # blocks per sequence per step
    gamma: float = 4.0  # position decay
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    epochs: int = 6
    batch_size: int = 4
    seed: int = 0
    bf16: bool = False  # autocast (CUDA only; CPU bf16 is slower here)
    save_every: int = 200  # steps between resumable checkpoints
    max_len: int = 2048


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    seconds: float = 0.0


class OfflineTrainer:
    """Trains a DFlash drafter for `target` on regenerated sequences.

    Args:
        target: the frozen target (features, embedding, lm_head).
        drafter: the drafter to train (e.g. `DFlashDrafter(cfg)` from a config).
        out_dir: where the final checkpoint, `train_state.pt` and logs go.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter,
        cfg: OfflineTrainConfig,
        out_dir: str | Path,
    ):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.out_dir = Path(out_dir)
        self.num_drafts = cfg.block_size - 1
        if self.num_drafts < 1:
            raise AdaFlashConfigError("block_size must be >= 2")
        self.decay = position_decay_weights(self.num_drafts, cfg.gamma)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.state = TrainState()
        self.generator = torch.Generator().manual_seed(cfg.seed)

    # ------------------------------------------------------------------ loop
    def train(self, seqs: list[Sequence]) -> TrainState:
        seqs = [s for s in seqs if len(s.token_ids) - s.prompt_len >= 2]
        seqs = [_truncate(s, self.cfg.max_len) for s in seqs]
        if not seqs:
            raise AdaFlashConfigError("no training sequence has >= 2 response tokens")
        steps_per_epoch = math.ceil(len(seqs) / self.cfg.batch_size)
        total = steps_per_epoch * self.cfg.epochs
        self._maybe_resume(total)
        bar = tqdm(
            total=total, initial=self.state.step, desc="train-drafter", unit="step"
        )
        while self.state.step < total:
            epoch, i = divmod(self.state.step, steps_per_epoch)
            order = torch.randperm(
                len(seqs),
                generator=torch.Generator().manual_seed(self.cfg.seed + epoch),
            ).tolist()
            idx = order[i * self.cfg.batch_size : (i + 1) * self.cfg.batch_size]
            loss, tokens = self.train_step([seqs[j] for j in idx], total)
            self.state.losses.append(loss)
            self.state.tokens_seen += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if self.state.step % self.cfg.save_every == 0 or self.state.step == total:
                self.save_resume_point(total)
        bar.close()
        return self.state

    def train_step(self, seqs: list[Sequence], total_steps: int) -> tuple[float, int]:
        """One optimizer step; returns (loss, response tokens in the batch)."""
        t0 = time.perf_counter()
        self.drafter.train()
        self._set_lr(total_steps)
        batch = make_batch(
            seqs, num_anchors=self.cfg.num_anchors, generator=self.generator
        )
        features, _ = self.target.features(
            batch.input_ids,
            self.drafter.target_layer_ids,
            batch.valid.long(),
            with_logits=False,
        )
        labels, label_valid, _ = block_labels(batch, self.num_drafts)
        with self._autocast():
            logits, _ = student_logits(
                self.drafter, self.target, batch, features, self.num_drafts
            )
        w = self.decay.view(1, 1, -1) * label_valid
        ce = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 2), labels.flatten(), reduction="none"
        )
        loss = (ce * w.flatten()).sum() / w.sum().clamp_min(1e-9)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.state.step += 1
        self.state.seconds += time.perf_counter() - t0
        tokens = sum(len(s.token_ids) - s.prompt_len for s in seqs)
        return loss.item(), tokens

    def _set_lr(self, total: int) -> None:
        warm = max(1, int(self.cfg.warmup * total))
        s = self.state.step
        scale = (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
        )
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * scale

    def _autocast(self):
        if self.cfg.bf16 and torch.cuda.is_available():
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    # ------------------------------------------------------------ checkpoints
    def save_resume_point(self, total: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "train_state.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "state": asdict(self.state),
                "config": asdict(self.cfg),
                "drafter_config": self.drafter.cfg,
                "total_steps": total,
            },
            tmp,
        )
        tmp.replace(path)

    def _maybe_resume(self, total: int) -> None:
        path = self.out_dir / "train_state.pt"
        if not path.exists():
            return
        ckpt = torch.load(path, weights_only=False)
        if ckpt["drafter_config"] != self.drafter.cfg or ckpt["config"] != asdict(
            self.cfg
        ):
            raise AdaFlashConfigError(
                f"{path} was written by a run with another drafter or training config;"
                " use a fresh --out directory or the same options to resume."
            )
        self.drafter.load_state_dict(ckpt["drafter"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.state = TrainState(**ckpt["state"])

    def save_checkpoint(self, path: str | Path, *, metrics: dict | None = None) -> Path:
        """Write the z-lab-format drafter (loads in stock vLLM and AdaFlash)."""
        out = save_drafter(path, self.drafter.cfg, self.drafter.state_dict())
        if metrics:
            (out / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
        return out


def _truncate(s: Sequence, max_len: int) -> Sequence:
    if len(s.token_ids) <= max_len:
        return s
    return Sequence(s.token_ids[:max_len], min(s.prompt_len, max_len), s.domain)


@torch.no_grad()
def anchor_acceptance(
    drafter: DFlashDrafter,
    target: TargetModel,
    seqs: list[Sequence],
    num_drafts: int,
    *,
    batch_size: int = 4,
) -> Iterator[tuple[Sequence, dict[int, int]]]:
    """(sequence, {anchor: drafts greedy verification accepts}) at every response
    position of each sequence with at least 2 response tokens. One forward drafts
    from every anchor at once (drafts at anchor a depend only on the prefix up to
    a)."""
    drafter.eval()
    for i in range(0, len(seqs), batch_size):
        chunk = [
            s for s in seqs[i : i + batch_size] if len(s.token_ids) - s.prompt_len >= 2
        ]
        if not chunk:
            continue
        batch = make_batch(chunk, num_anchors=None)
        features, _ = target.features(
            batch.input_ids,
            drafter.target_layer_ids,
            batch.valid.long(),
            with_logits=False,
        )
        logits, _ = student_logits(drafter, target, batch, features, num_drafts)
        labels, label_valid, _ = block_labels(batch, num_drafts)
        acc = accepted_lengths(logits.argmax(-1), labels, label_valid)
        for j, s in enumerate(chunk):
            yield s, dict(zip(batch.anchors[j].tolist(), acc[j].tolist(), strict=True))


def evaluate_tau(
    drafter: DFlashDrafter,
    target: TargetModel,
    seqs: list[Sequence],
    num_drafts: int,
    *,
    batch_size: int = 4,
) -> dict:
    """tau as greedy verification would measure it along each sequence: the
    accepted drafts at every anchor (`anchor_acceptance`), then the rounds walked
    exactly as verification would."""
    rounds = emitted = 0
    for s, by_anchor in anchor_acceptance(
        drafter, target, seqs, num_drafts, batch_size=batch_size
    ):
        r, e = greedy_tau(by_anchor, s)
        rounds += r
        emitted += e
    return {
        "tau": emitted / max(1, rounds),
        "rounds": rounds,
        "tokens": emitted,
        "num_drafts": num_drafts,
        "sequences": len(seqs),
    }


def load_or_init_drafter(path: str | Path | None, cfg: dict | None) -> DFlashDrafter:
    """A drafter from a checkpoint folder, or freshly initialised from `cfg`."""
    if path is not None and Path(path).exists():
        cfg, state = load_drafter(path)
        drafter = DFlashDrafter(cfg)
        drafter.load_state_dict(state)
        return drafter
    if cfg is None:
        raise AdaFlashConfigError(f"drafter checkpoint not found: {path}")
    drafter = DFlashDrafter(cfg)
    _init_weights(drafter)
    return drafter


def _init_weights(drafter: DFlashDrafter, std: float = 0.02) -> None:
    for name, p in drafter.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, std)
        elif name.endswith("weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
