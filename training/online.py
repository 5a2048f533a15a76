"""The online on-policy distillation trainer (`adaflash trainer`).

A separate process with its own frozen copy of the target. It tails the trajectory
buffer; once `online.train_every` new trajectories are waiting it takes the newest
that many (passing over older ones when it lags: `newest_batch`), recomputes the
target's pre-norm features and logits along the served sequences, runs the drafter on
blocks anchored at the logged round positions (plus random ones), takes AdamW steps
on the OPD loss (`adaflash_vllm.kernels.opd_loss`: Triton on CUDA, the torch
reference elsewhere), publishes a new version and offers it to the engine's workers
over the torch.distributed weight channel.

State that survives a crash (versions_dir/trainer/): the buffer position and the
optimizer; the weights resume from the newest good published version.

Run: adaflash trainer --config adaflash.json --target MODEL
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from adaflash_vllm.proposers.length_head import (
    draft_confidence,
    ece_bin_sums,
    round_history,
)
from adaflash_vllm.training.blocks import (
    accepted_lengths,
    block_labels,
    gather_teacher,
    make_batch,
    student_logits,
)
from adaflash_vllm.training.data import Sequence
from adaflash_vllm.training.drafter import DFlashDrafter
from adaflash_vllm.training.features import TargetModel
from adaflash_vllm.training.head import head_loss, head_targets
from adaflash_vllm.training.losses import position_decay_weights
from adaflash_vllm.training.replay import ReplayPool
from vllm.logger import init_logger

from adaflash_vllm.buffer import BufferPosition, BufferReader, Trajectory
from adaflash_vllm.config import AdaFlashConfig, OnlineConfig
from adaflash_vllm.errors import AdaFlashConfigError
from adaflash_vllm.versions import (
    latest_version,
    newest_good_version,
    publish_version,
    rejected_versions,
)

logger = init_logger(__name__)

HEARTBEAT = "trainer.json"
REPLAY_FILE = "replay.msgpack"  # in versions_dir/trainer/
HEAD_LR = 2e-4  # the AdaFlash paper's head learning rate


@dataclass
class RoundMetrics:
    """What one training round did (also stored in the version's manifest)."""

    trajectories: int
    steps: int
    loss: float
    ce: float
    rkl: float
    clip_fraction: float
    clipped_rows_fraction: float
    accept_before: float  # mean greedy accepted drafts per block, first epoch
    accept_after: float  # same blocks, after training (no grad)
    seconds: float
    tokens_per_s: float
    head_mse: float  # length head's MSE on realised acceptance (0: no head)
    # Length head's MAE (median forecast of the accepted fraction of K, labels
    # from the recomputed target) on this round's logged rounds, each scored in
    # the first epoch before any optimizer step trained on its sequence: its
    # calibration on traffic it had not seen (None: no head or no logged round)
    head_served_mae: float | None = None
    # on the same blocks: the expected calibration error of the predicted mean
    # (10 bins), and the MAE of a constant forecast, the previous round's
    # realised median (None on the first round): what the head's MAE is worth
    head_served_ece: float | None = None
    head_served_mae_constant: float | None = None
    stale_skipped: int = 0  # trajectories passed over for newer ones, so far
    # earlier trajectories trained on besides (`online.replay`, training/replay.py)
    replayed: int = 0


def newest_batch(
    pending: list[Trajectory], train_every: int
) -> tuple[list[Trajectory] | None, list[Trajectory], int]:
    """The next round's trajectories: the newest `train_every` once that many are
    waiting, and those older than them are passed over. A trainer slower than the
    traffic then learns from what the engine serves now, not from a backlog that
    grows without end (after a domain shift it would go on training on the old
    domain). Returns (batch or None, still pending, passed over)."""
    if len(pending) < train_every:
        return None, pending, 0
    return pending[-train_every:], [], len(pending) - train_every


class OnlineTrainer:
    """Distils the drafter from served trajectories; see the module docstring.

    Args:
        cfg: the `adaflash` section (its `online` part drives the trainer).
        target_path: the served target model (HF folder).
        drafter_path: the drafter the engine started from (version 0).
        num_drafts: K, the engine's num_speculative_tokens.
    """

    def __init__(
        self,
        cfg: AdaFlashConfig,
        *,
        target_path: str,
        drafter_path: str,
        num_drafts: int,
        device: str = "cpu",
        push: bool | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.cfg: OnlineConfig = cfg.online
        self.num_drafts = num_drafts
        self.device = torch.device(device)
        # Data parallel: every rank trains on its share of each step's sequences;
        # rank 0 alone reads the buffer, publishes, pushes and writes state.
        self.rank, self.world = rank, world_size
        self.is_main = rank == 0
        self.state_dir = Path(self.cfg.versions_dir) / "trainer"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.target = TargetModel(target_path, device=self.device)
        self.drafter_path = drafter_path
        self.version, self.drafter = self._load_drafter()
        self._check_fits_target()
        self.model = self._wrap_ddp(self.drafter)
        self.decay = position_decay_weights(num_drafts, self.cfg.gamma).to(self.device)
        self.optimizer = self._make_optimizer()
        self.reader = BufferReader(self.cfg.buffer_dir, self._load_position())
        self._restore_optimizer()
        self.pending: list[Trajectory] = []
        self.stale_skipped = 0  # trajectories passed over for newer ones
        # earlier traffic trained on again each round (rank 0 samples it)
        self.replay: ReplayPool | None = None
        if self.cfg.replay > 0 and self.is_main:
            self.replay = ReplayPool(self.cfg.replay_pool)
            problem = self.replay.load(self.state_dir / REPLAY_FILE)
            if problem:
                logger.warning(
                    "AdaFlash trainer: the replay pool could not be read (%s); "
                    "it starts empty",
                    problem,
                )
        # the last round's realised median on its logged rounds: the constant
        # forecast the head's served MAE is set against
        self._last_served_median: float | None = None
        self.session = uuid.uuid4().hex[:12]
        self.push_server = None
        self.status = "idle"
        self.history: list[dict] = []
        self._beat_stop = threading.Event()
        if not self.is_main:
            return
        if self.cfg.push if push is None else push:
            from adaflash_vllm.transport import PushServer

            self._check_port_free()
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.push_server = PushServer(
                self.cfg.push_host, self.cfg.push_port, backend=backend
            ).start()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _wrap_ddp(self, drafter: DFlashDrafter) -> torch.nn.Module:
        if self.world == 1:
            return drafter
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(drafter, device_ids=ids)

    def _all_reduce(self, values: list[float]) -> list[float]:
        """Sum `values` over ranks (identity with one rank)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(
            values,
            dtype=torch.float64,
            device=self.device if self.device.type == "cuda" else "cpu",
        )
        dist.all_reduce(t)
        return t.tolist()

    def _broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; the length head (if any) in its own group at `HEAD_LR`."""
        head = self.drafter.length_head
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        groups = [
            {
                "params": [
                    p for p in self.drafter.parameters() if id(p) not in head_ids
                ],
                "lr": self.cfg.lr,
            }
        ]
        if head is not None:
            groups.append({"params": list(head.parameters()), "lr": HEAD_LR})
        return torch.optim.AdamW(groups)

    # ------------------------------------------------------------- startup
    def _load_drafter(self) -> tuple[int, DFlashDrafter]:
        from adaflash_vllm.training.checkpoint import load_drafter

        good = newest_good_version(self.cfg.versions_dir)
        path, version = (good.path, good.version) if good else (self.drafter_path, 0)
        cfg, state = load_drafter(path)
        drafter = DFlashDrafter(cfg).to(self.device)
        drafter.load_state_dict(state)
        return version, drafter

    def _check_fits_target(self) -> None:
        n = self.target.num_layers
        bad = [i for i in self.drafter.target_layer_ids if not 0 <= i < n]
        hidden = self.target.config["hidden_size"]
        if bad or self.drafter.cfg["hidden_size"] != hidden:
            raise AdaFlashConfigError(
                f"the drafter ({self.drafter_path}) does not fit the trainer's target "
                f"{self.target.path} (target_layer_ids "
                f"{self.drafter.target_layer_ids} vs "
                f"{n} layers, hidden {self.drafter.cfg['hidden_size']} vs {hidden}); "
                "start the trainer with the engine's target and drafter."
            )

    def _check_port_free(self) -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((self.cfg.push_host, self.cfg.push_port))
            except OSError as e:
                raise AdaFlashConfigError(
                    f"online.push_port {self.cfg.push_port} on {self.cfg.push_host} is "
                    f"in use ({e}); pick a free port in adaflash.json (the engine "
                    "reads the same file) or stop the other trainer."
                ) from None

    def _load_position(self) -> BufferPosition:
        try:
            data = json.loads((self.state_dir / "state.json").read_text())
            return BufferPosition(**data["buffer"])
        except (OSError, ValueError, KeyError):
            return BufferPosition()

    def _restore_optimizer(self) -> None:
        path = self.state_dir / "optimizer.pt"
        if not path.exists():
            return
        saved = torch.load(path, weights_only=False)
        if saved.get("version") == self.version:
            self.optimizer.load_state_dict(saved["optimizer"])

    def _save_state(self) -> None:
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "buffer": asdict(self.reader.position),
                    "version": self.version,
                    "session": self.session,
                }
            )
        )
        tmp.replace(self.state_dir / "state.json")
        torch.save(
            {"version": self.version, "optimizer": self.optimizer.state_dict()},
            self.state_dir / "optimizer.pt.tmp",
        )
        os.replace(self.state_dir / "optimizer.pt.tmp", self.state_dir / "optimizer.pt")
        if self.replay is not None:
            self.replay.save(self.state_dir / REPLAY_FILE)

    def _heartbeat(self) -> None:
        path = Path(self.cfg.versions_dir) / HEARTBEAT
        while not self._beat_stop.is_set():
            beat = {
                "session": self.session,
                "host": self.cfg.push_host,
                "port": self.cfg.push_port,
                "pid": os.getpid(),
                "time": time.time(),
                "version": self.version,
                "status": self.status,
                "push": self.push_server is not None,
            }
            if self.push_server is None:
                beat["host"] = beat["port"] = None
            try:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(beat))
                tmp.replace(path)
            except OSError:
                pass
            self._beat_stop.wait(2.0)

    # ---------------------------------------------------------------- loop
    def run(
        self,
        *,
        max_rounds: int | None = None,
        idle_sleep_s: float = 0.5,
        stop: threading.Event | None = None,
    ) -> None:
        """Tail the buffer and train every `train_every` trajectories."""
        rounds = 0
        while max_rounds is None or rounds < max_rounds:
            batch, stopping = None, bool(stop and stop.is_set())
            if self.is_main and not stopping:
                self.pending.extend(self.reader.read_new())
                batch, self.pending, passed = newest_batch(
                    self.pending, self.cfg.train_every
                )
                self.stale_skipped += passed
            batch, stopping = self._broadcast((batch, stopping))
            if stopping:
                break
            if batch is None:
                self.status = "waiting"
                time.sleep(idle_sleep_s)
                continue
            self.train_round(batch)
            rounds += 1

    def train_round(self, trajectories: list[Trajectory]) -> RoundMetrics:
        """Distil on `trajectories` (and, with `online.replay`, on earlier ones
        drawn from the replay pool), publish and offer the new version."""
        self.status = "training"
        self._follow_rejections()
        replayed = self._broadcast(self._draw_replay(len(trajectories)))
        seqs, forced = self._sequences(trajectories)
        fresh = len(seqs)
        old_seqs, old_forced = self._sequences(replayed)
        seqs, forced = seqs + old_seqs, forced + old_forced
        t0 = time.perf_counter()
        sums: dict[str, float] = defaultdict(float)
        steps = tokens = 0
        order = list(range(fresh))
        old = list(range(fresh, len(seqs)))
        rng = random.Random(self.version)
        size = self.cfg.batch_size
        for epoch in range(self.cfg.epochs):
            rng.shuffle(order)
            # (indices, start, measured): each step is all new or all replayed
            # sequences, so that the first epoch's measurements (accepted drafts,
            # the head's calibration on rounds it has not seen) are the new ones'
            batches = [(order, i, epoch == 0) for i in range(0, fresh, size)]
            if old:
                rng.shuffle(old)
                batches += [(old, i, False) for i in range(0, len(old), size)]
                rng.shuffle(batches)
            for part, i, measured in batches:
                idx = self._shard(part, i)
                out = self.step(
                    [seqs[j] for j in idx],
                    [forced[j] for j in idx],
                    measure_accept=measured,
                )
                steps += 1
                tokens += sum(len(seqs[j].token_ids) for j in idx)
                for key, value in out.items():
                    sums[key] += value
        keys = sorted(sums)
        sums = dict(zip(keys, self._all_reduce([sums[k] for k in keys]), strict=True))
        tokens = int(self._all_reduce([float(tokens)])[0])
        accept_after = self.measure_accept(seqs[:fresh], forced[:fresh])
        served, self._last_served_median = served_calibration(
            sums, self._last_served_median
        )
        seconds = time.perf_counter() - t0
        metrics = RoundMetrics(
            trajectories=len(trajectories),
            steps=steps,
            loss=sums["loss"] / max(sums["w"], 1e-9),
            ce=sums["ce"] / max(sums["w"], 1e-9),
            rkl=sums["rkl"] / max(sums["w"], 1e-9),
            clip_fraction=sums["clipped"] / max(1, sums["entries"]),
            clipped_rows_fraction=sums["rows_clipped"] / max(1, sums["rows"]),
            accept_before=sums["acc"] / max(1, sums["blocks"]),
            accept_after=accept_after,
            seconds=seconds,
            tokens_per_s=tokens / seconds,
            head_mse=sums["head_mse"] / max(1, steps * self.world),
            **served,
            stale_skipped=self.stale_skipped,
            replayed=len(replayed),
        )
        if self.replay is not None:
            self.replay.add(trajectories)  # (saved with the state by publish)
        if self.is_main:
            self.publish(metrics)
        self.version = self._broadcast(self.version)
        self.status = "idle"
        return metrics

    def _draw_replay(self, fresh: int) -> list[Trajectory]:
        """Rank 0: `online.replay` x `fresh` trajectories of the replay pool
        (fewer while it holds fewer); other ranks get them by broadcast."""
        if self.replay is None:
            return []
        return self.replay.sample(round(self.cfg.replay * fresh))

    def _shard(self, order: list[int], start: int) -> list[int]:
        """This rank's part of the global step starting at `start` (the global batch
        is `batch_size` sequences; a short last batch wraps around so every rank
        gets work and DDP's collectives line up)."""
        size = max(self.cfg.batch_size, self.world)
        idx = [order[(start + j) % len(order)] for j in range(size)]
        return idx[self.rank :: self.world]

    def _sequences(
        self, trajectories: list[Trajectory]
    ) -> tuple[list[Sequence], list[dict[int, tuple[int, int]]]]:
        """The served sequences and, per sequence, its logged rounds' anchors,
        each with the round before it as (accepted, verified) drafts ((0, 0) for
        the first): what a length head with history read when it was served."""
        seqs, forced = [], []
        for t in trajectories:
            ids = (t.prompt_token_ids + t.output_token_ids)[: self.cfg.max_len]
            prompt_len = min(len(t.prompt_token_ids), len(ids))
            seqs.append(Sequence(ids, prompt_len, t.domain or ""))
            # The drafter block of a round was anchored at its position - 1.
            before = zip([0, *t.round_accepted], [0, *t.round_drafts], strict=False)
            forced.append(
                {
                    p - 1: prev
                    for p, prev in zip(t.round_positions, before, strict=False)
                    if p - 1 < len(ids) - 1
                }
            )
        return seqs, forced

    def step(
        self,
        seqs: list[Sequence],
        forced: list[dict[int, tuple[int, int]]],
        *,
        measure_accept: bool,
    ) -> dict[str, float]:
        """One AdamW step on the OPD loss over the blocks of `seqs`."""
        from adaflash_vllm.kernels import opd_loss

        self.drafter.train()
        batch = make_batch(
            seqs, num_anchors=self.cfg.num_anchors, forced_anchors=forced
        )
        batch = _to(batch, self.device)
        features, target_logits = self.target.features(
            batch.input_ids, self.drafter.target_layer_ids, batch.valid.long()
        )
        labels, label_valid, teacher_index = block_labels(batch, self.num_drafts)
        logits, hidden = student_logits(
            self.model, self.target, batch, features, self.num_drafts
        )
        teacher = gather_teacher(target_logits, teacher_index)
        weights = (self.decay.view(1, 1, -1) * label_valid).flatten()
        v = logits.shape[-1]
        out = opd_loss(
            logits.reshape(-1, v),
            teacher.reshape(-1, v),
            alpha=self.cfg.alpha,
            delta=self.cfg.delta,
            weights=weights,
        )
        # (sum, count) pairs: divide by the weight of the global batch; DDP then
        # averages gradients over ranks, hence the factor `world`.
        global_w = self._all_reduce([float(out.weight_sum)])[0]
        loss = out.loss_sum * (self.world / max(global_w, 1e-12))
        head_mse = head_abs_error = 0.0
        head_scored = 0
        calibration_sums: dict[str, float] = {}
        if self.drafter.length_head is not None:
            # Labels over the whole block of K, from the recomputed target.
            with torch.no_grad():
                accepted, valid_slots = head_targets(logits, labels, label_valid)
                confidence = draft_confidence(logits)
            mask = (batch.anchor_valid & label_valid.any(-1)).float()
            head = self.drafter.length_head
            h = head_loss(
                head,
                hidden,
                confidence,
                accepted,
                valid_slots,
                mask,
                history=(
                    _forced_history(batch.anchors, forced, self.num_drafts)
                    if head.history
                    else None
                ),
                scored=_served_blocks(batch.anchors, forced),
            )
            loss, head_mse = loss + h.loss, h.mse
            if measure_accept:
                # first epoch: each sequence scored before any step trained on it
                head_abs_error, head_scored = h.abs_error, h.scored
                calibration_sums = served_calibration_sums(
                    h.scored_mean, h.scored_real, self._last_served_median
                )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Per group: the head's loss (a likelihood, detached inputs) must not
        # scale the drafter's step through a shared gradient norm.
        for group in self.optimizer.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], self.cfg.grad_clip)
        self.optimizer.step()
        acc, blocks = 0.0, 0
        if measure_accept:
            with torch.no_grad():
                lens = accepted_lengths(logits.argmax(-1), labels, label_valid)
                acc, blocks = (
                    float(lens[batch.anchor_valid].sum()),
                    int(batch.anchor_valid.sum()),
                )
        return {
            "loss": float(out.loss_sum.detach()),
            "ce": float(out.ce_sum),
            "rkl": float(out.rkl_sum),
            "w": float(out.weight_sum),
            "clipped": int(out.clipped_entries),
            "entries": out.total_entries,
            "rows_clipped": int(out.clipped_rows),
            "rows": int((weights > 0).sum()),
            "acc": acc,
            "blocks": blocks,
            "head_mse": head_mse,
            "head_abs_error": head_abs_error,
            "head_scored": head_scored,
            **calibration_sums,
        }

    @torch.no_grad()
    def measure_accept(
        self, seqs: list[Sequence], forced: list[dict[int, tuple[int, int]]]
    ) -> float:
        """Mean greedy accepted drafts per logged block with the current weights."""
        self.drafter.eval()
        total, blocks = 0.0, 0
        for i in range(0, len(seqs), max(1, self.cfg.batch_size * 4)):
            chunk, anchors = (
                seqs[i : i + self.cfg.batch_size * 4],
                forced[i : i + self.cfg.batch_size * 4],
            )
            batch = _to(
                make_batch(chunk, num_anchors=0, forced_anchors=anchors), self.device
            )
            if not bool(batch.anchor_valid.any()):
                continue
            features, _ = self.target.features(
                batch.input_ids,
                self.drafter.target_layer_ids,
                batch.valid.long(),
                with_logits=False,
            )
            logits, _ = student_logits(
                self.drafter, self.target, batch, features, self.num_drafts
            )
            labels, label_valid, _ = block_labels(batch, self.num_drafts)
            lens = accepted_lengths(logits.argmax(-1), labels, label_valid)
            total += float(lens[batch.anchor_valid].sum())
            blocks += int(batch.anchor_valid.sum())
        return total / max(1, blocks)

    # ------------------------------------------------------------- publish
    def publish(self, metrics: RoundMetrics) -> int:
        version = max(self.version, latest_version(self.cfg.versions_dir)) + 1
        state = {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()}
        publish_version(
            self.cfg.versions_dir,
            version,
            self.drafter.cfg,
            state,
            {
                "parent_version": self.version,
                "session": self.session,
                "metrics": asdict(metrics),
            },
        )
        self.version = version
        if self.push_server is not None:
            self.push_server.offer(version, state)
        self._save_state()
        self.history.append({"version": version, **asdict(metrics)})
        _event(
            "published",
            version=version,
            **{
                k: round(v, 5) if isinstance(v, float) else v
                for k, v in asdict(metrics).items()
            },
        )
        return version

    def _follow_rejections(self) -> None:
        """If the engine rejected or rolled back our latest version, continue from the
        newest good one instead (never build on a version serving refused)."""
        rejected = (
            self.is_main
            and self.version
            and self.version in rejected_versions(self.cfg.versions_dir)
        )
        if self._broadcast(bool(rejected)):
            good = newest_good_version(self.cfg.versions_dir)
            version, drafter = self._load_drafter()
            self.drafter.load_state_dict(drafter.state_dict())
            self.version = version
            self.optimizer = self._make_optimizer()
            _event(
                "rollback_followed", version=version, good=good.version if good else 0
            )

    def close(self) -> None:
        self._beat_stop.set()
        if self.push_server is not None:
            self.push_server.stop()


def _forced_history(
    anchors: torch.Tensor, forced: list[dict[int, tuple[int, int]]], num_drafts: int
) -> torch.Tensor:
    """History features [B, M, 3] (`length_head.round_history`) of a batch's
    blocks: a logged round's block reads the round before it; the random blocks
    read none."""
    prev = [
        [forced[b].get(a, (0, 0)) for a in row]
        for b, row in enumerate(anchors.tolist())
    ]
    pairs = torch.tensor(prev, dtype=torch.long).view(*anchors.shape, 2)
    return round_history(pairs[..., 0], pairs[..., 1], num_drafts).to(anchors.device)


# calibration sums of the served (logged-round) blocks: fixed keys on every rank
# (they are all-reduced by name), ECE bins of the predicted mean and a histogram
# of the realised fraction (its median: the next round's constant forecast)
_ECE_BINS = 10
_REAL_BINS = 101


def served_calibration_sums(
    mean: torch.Tensor, real: torch.Tensor, constant: float | None
) -> dict[str, float]:
    """Per-step sums for `served_calibration` from the scored blocks' predicted
    mean and realised fraction [N], and the constant forecast to score (None: no
    previous round). The same keys whatever the blocks: they add up over steps
    and are all-reduced over ranks by name."""
    out: dict[str, float] = {}
    pred_sums, real_sums = ece_bin_sums(mean, real, _ECE_BINS)
    for b in range(_ECE_BINS):
        out[f"ece_p{b}"] = float(pred_sums[b])
        out[f"ece_r{b}"] = float(real_sums[b])
    hist = torch.bincount(
        (real.clamp(0, 1) * (_REAL_BINS - 1)).round().long(), minlength=_REAL_BINS
    )
    for b in range(_REAL_BINS):
        out[f"real_h{b}"] = float(hist[b])
    out["const_abs_error"] = (
        float((real - constant).abs().sum()) if constant is not None else 0.0
    )
    return out


def served_calibration(
    sums: dict[str, float], last_median: float | None
) -> tuple[dict[str, float | None], float | None]:
    """A round's calibration on its logged rounds (RoundMetrics' head_served_*
    fields) from its all-reduced step sums (`served_calibration_sums`), and the
    median realised fraction, the next round's constant forecast (`last_median`
    when the round scored nothing)."""
    n = sums.get("head_scored", 0.0)
    if not n or "ece_p0" not in sums:
        return {}, last_median
    ece = sum(abs(sums[f"ece_p{b}"] - sums[f"ece_r{b}"]) for b in range(_ECE_BINS))
    counts = [sums[f"real_h{b}"] for b in range(_REAL_BINS)]
    half, seen, median = sum(counts) / 2, 0.0, last_median
    for b, c in enumerate(counts):
        seen += c
        if seen >= half:
            median = b / (_REAL_BINS - 1)
            break
    return {
        "head_served_mae": sums["head_abs_error"] / n,
        "head_served_ece": ece / n,
        "head_served_mae_constant": (
            sums["const_abs_error"] / n if last_median is not None else None
        ),
    }, median


def _served_blocks(
    anchors: torch.Tensor, forced: list[dict[int, tuple[int, int]]]
) -> torch.Tensor:
    """[B, M] bool: the blocks at logged rounds (not the random anchors)."""
    rows = [[a in forced[b] for a in row] for b, row in enumerate(anchors.tolist())]
    return torch.tensor(rows, dtype=torch.bool, device=anchors.device)


def _to(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    for name in ("input_ids", "valid", "anchors", "anchor_valid", "prompt_lens"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def add_trainer_args(p) -> None:
    p.add_argument("--config", required=True, help="the engine's adaflash.json")
    p.add_argument("--target", required=True, help="the served target model folder")
    p.add_argument("--drafter", help="version-0 drafter (default: the config's model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: config)")
    p.add_argument("--max-rounds", type=int, default=None, help="stop after N rounds")


def main_trainer(args) -> None:
    from adaflash_vllm.config import read_speculative_config, split_adaflash_section
    from adaflash_vllm.engine_setup import resolve_online_paths
    from adaflash_vllm.plugin import share_vllm_log_handlers

    share_vllm_log_handlers(configure=True)

    spec, cfg = split_adaflash_section(read_speculative_config(args.config))
    if cfg is None or not cfg.online.enabled:
        raise AdaFlashConfigError(
            f"{args.config}: the trainer needs an `adaflash.online` section with "
            '"enabled": true (the engine must log what it serves)'
        )
    cfg = resolve_online_paths(cfg)
    online = cfg.online
    device = args.device or (
        "cuda"
        if online.trainer_device == "cuda"
        or (online.trainer_device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    _event(
        "start",
        config=str(args.config),
        device=device,
        online={k: getattr(online, k) for k in online.__struct_fields__},
        git=_git_sha(),
    )
    job = {
        "cfg": cfg,
        "target": args.target,
        "drafter": args.drafter or spec["model"],
        "num_drafts": spec["num_speculative_tokens"],
        "device": device,
        "max_rounds": args.max_rounds,
    }
    if online.trainer_ranks == 1:
        run_rank(0, 1, None, job)
        return
    import torch.multiprocessing as tmp

    from adaflash_vllm.serve_process import free_port

    tmp.start_processes(
        run_rank,
        args=(online.trainer_ranks, free_port(), job),
        nprocs=online.trainer_ranks,
        start_method="spawn",
    )


def run_rank(rank: int, world_size: int, port: int | None, job: dict) -> None:
    """One trainer rank: pin cores, join the trainers' own process group (not the
    engine's), train until stopped."""
    from adaflash_vllm.plugin import share_vllm_log_handlers

    share_vllm_log_handlers(configure=True)  # trainer events in vLLM's log format
    cfg, device = job["cfg"], job["device"]
    cores = cfg.online.trainer_cores
    if cores:
        mine = cores[rank::world_size] or cores
        os.sched_setaffinity(0, set(mine))
        torch.set_num_threads(len(mine))
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
    trainer = OnlineTrainer(
        cfg,
        target_path=job["target"],
        drafter_path=job["drafter"],
        num_drafts=job["num_drafts"],
        device=device,
        rank=rank,
        world_size=world_size,
    )
    try:
        trainer.run(max_rounds=job["max_rounds"])
    except KeyboardInterrupt:
        pass
    finally:
        trainer.close()


def _event(name: str, **fields) -> None:
    """One JSON line per trainer event in the log (machine-readable)."""
    logger.info("%s", json.dumps({"event": name, **fields}))


def _git_sha() -> str:
    from adaflash_vllm.bench.results import git_sha

    return git_sha()
