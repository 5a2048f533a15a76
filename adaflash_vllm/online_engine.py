"""Engine-core side of online distillation: log trajectories, notice new drafter
versions between steps, order their swap, watch live tau and roll back.

The controller lives in `AdaFlashScheduler` (engine-core process). It never blocks
the engine loop: logging is a queue put, version discovery is one small file read
every `poll_interval_s`, and the swap itself runs in the workers at the start of
the next step (the scheduler attaches a `SwapOrder` to the `SchedulerOutput`; the
worker answers through the `ModelRunnerOutput`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from adaflash_vllm.buffer import BufferWriter, Trajectory
from adaflash_vllm.config import AdaFlashConfig, OnlineConfig, RuntimeInfo
from adaflash_vllm.versions import (
    latest_version,
    mark_rejected,
    newest_good_version,
    read_version,
    rejected_versions,
)

logger = init_logger(__name__)

HEARTBEAT = "trainer.json"
HEARTBEAT_FRESH_S = 15.0


@dataclass
class SwapOrder:
    """Sent to every worker with a SchedulerOutput: load `version` now."""

    version: int
    path: str
    push: dict[str, Any] | None  # {"host", "port", "session"} when the trainer is up
    reason: str = "new"  # "new" | "resume" | "rollback"


@dataclass
class RoundWindow:
    """Tokens per round (accepted + bonus) of one drafter version: its lifetime
    round count and its most recent `size` rounds (mean and variance of those)."""

    size: int
    rounds: int = 0
    recent: deque = field(default_factory=deque)

    def add(self, tokens: int) -> None:
        self.rounds += 1
        self.recent.append(tokens)
        if len(self.recent) > self.size:
            self.recent.popleft()

    @property
    def tau(self) -> float:
        return statistics.fmean(self.recent) if self.recent else 0.0

    @property
    def var(self) -> float:
        return statistics.pvariance(self.recent) if len(self.recent) > 1 else 0.0


def regressed(
    base: RoundWindow, cur: RoundWindow, margin: float, z: float = 2.0
) -> bool:
    """True when `cur` accepts less than `base` by more than `margin` (relative)
    and the gap is beyond noise: more than `z` standard errors of the difference
    of the two window means. Per-round acceptance is noisy (prompts differ a lot),
    so a margin alone would roll back good versions on unlucky windows."""
    if not base.recent or not cur.recent:
        return False
    gap = base.tau - cur.tau
    se = (base.var / len(base.recent) + cur.var / len(cur.recent)) ** 0.5
    return cur.tau < base.tau * (1 - margin) and gap > z * se


@dataclass
class OnlineCounters:
    swaps: int = 0
    swap_failures: int = 0
    rollbacks: int = 0
    rejected: int = 0
    last_swap_stall_ms: float = 0.0
    not_logged: int = 0  # requests opted out
    log_errors: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class OnlineController:
    def __init__(self, cfg: AdaFlashConfig, runtime: RuntimeInfo):
        self.cfg: OnlineConfig = cfg.online
        self.runtime = runtime
        self.counters = OnlineCounters()
        self.writer = self._open_writer()
        self.version = 0  # the drafter the engine loaded
        self.previous_good = 0
        self.pending: SwapOrder | None = None
        good = newest_good_version(self.cfg.versions_dir)
        if good is not None:  # restart: resume from the newest good version
            self.pending = SwapOrder(good.version, str(good.path), None, "resume")
        self.in_flight: SwapOrder | None = None
        self._last_poll = 0.0
        # The live version's rounds, and the previous live version's most recent
        # window at the moment of the swap: the gate compares the two, so the
        # baseline is the traffic just before the swap, not the version's lifetime.
        self.live_rounds = RoundWindow(max(1, self.cfg.gate_window))
        self.gate_baseline: RoundWindow | None = None
        self._gauges: dict[str, float] = {}
        self._gauges_at = 0.0
        self._metrics_version = -1
        self._metrics: dict[str, float] = {}
        self._trainer: subprocess.Popen | None = None
        if self.cfg.spawn_trainer:
            self._trainer = spawn_trainer(cfg, runtime)

    def _open_writer(self) -> BufferWriter | None:
        try:
            Path(self.cfg.buffer_dir).mkdir(parents=True, exist_ok=True)
            Path(self.cfg.versions_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.error(
                "AdaFlash online: cannot create %s / %s (%s); serving goes on "
                "without logging (every finished request counted as dropped)",
                self.cfg.buffer_dir,
                self.cfg.versions_dir,
                e,
            )
            return None
        return BufferWriter(
            self.cfg.buffer_dir,
            max_bytes=int(self.cfg.buffer_max_mb * 2**20),
            segment_bytes=int(self.cfg.segment_mb * 2**20),
            queue_size=self.cfg.queue_size,
        )

    # ---------------------------------------------------------------- logging
    def log_request(self, request, rounds) -> None:
        params = request.sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        if not extra.get("adaflash_log", self.cfg.log_requests):
            self.counters.not_logged += 1
            return
        if self.writer is None:
            self.counters.log_errors += 1
            return
        reason = request.get_finished_reason()
        self.writer.append(
            Trajectory(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids or []),
                output_token_ids=list(request.output_token_ids),
                round_positions=list(rounds.positions) if rounds else [],
                round_drafts=list(rounds.num_drafts) if rounds else [],
                round_accepted=list(rounds.num_accepted) if rounds else [],
                drafter_version=self.version,
                temperature=float(params.temperature) if params is not None else 0.0,
                finish_reason=str(reason) if reason is not None else "unknown",
                domain=extra.get("adaflash_domain"),
                created=time.time(),
            )
        )

    # ------------------------------------------------------- version discovery
    def poll(self) -> None:
        """Between steps: queue a swap when a newer good version was published."""
        now = time.monotonic()
        if (
            self.in_flight is not None
            or now - self._last_poll < self.cfg.poll_interval_s
        ):
            return
        self._last_poll = now
        latest = latest_version(self.cfg.versions_dir)
        target = self.pending.version if self.pending else self.version
        if latest <= target or latest in rejected_versions(self.cfg.versions_dir):
            return
        info = read_version(self.cfg.versions_dir, latest)
        if info is None:
            return
        self.pending = SwapOrder(latest, str(info.path), self._push_info())

    def _push_info(self) -> dict[str, Any] | None:
        if not self.cfg.push:
            return None
        try:
            beat = json.loads((Path(self.cfg.versions_dir) / HEARTBEAT).read_text())
        except (OSError, ValueError):
            return None
        if time.time() - beat.get("time", 0) > HEARTBEAT_FRESH_S:
            return None  # trainer gone: load from disk without waiting on it
        return {"host": beat["host"], "port": beat["port"], "session": beat["session"]}

    def take_order(self) -> SwapOrder | None:
        """The swap to attach to the next SchedulerOutput (at most one in flight)."""
        if self.pending is None or self.in_flight is not None:
            return None
        self.in_flight, self.pending = self.pending, None
        return self.in_flight

    def on_swap_result(self, result: dict[str, Any] | None) -> None:
        order, self.in_flight = self.in_flight, None
        if order is None:
            return
        self._gauges_at = 0.0  # the next snapshot shows the swap's outcome
        if result is None or result.get("pending"):
            # The step did not reach the workers' swap hook, or the workers are
            # still fetching the version in the background: order it again (unless
            # a newer version replaces it first).
            self.pending = order
            return
        self.counters.last_swap_stall_ms = 1e3 * result.get("stall_s", 0.0)
        if result.get("ok"):
            if order.reason == "rollback":
                self.gate_baseline = None  # back to a version already judged
            else:
                self.previous_good = self.version
                self.gate_baseline = self.live_rounds
            self.version = order.version
            self.counters.swaps += 1
            self.live_rounds = RoundWindow(max(1, self.cfg.gate_window))
            staging = result.get("staging") or {}
            logger.info(
                "AdaFlash: drafter version %d live (%s; received in the background "
                "in %.1f ms, checked and staged over %d steps in %.1f ms; no step "
                "waited more than %.1f ms)",
                order.version,
                result.get("via"),
                1e3 * result.get("fetch_s", 0.0),
                staging.get("steps", 0),
                1e3 * staging.get("stage_s", 0.0),
                self.counters.last_swap_stall_ms,
            )
        else:
            self.counters.swap_failures += 1
            self.counters.rejected += 1
            mark_rejected(
                self.cfg.versions_dir,
                order.version,
                f"rejected by the engine: {result.get('error')}",
            )
            logger.warning(
                "AdaFlash: version %d rejected, keeping %d: %s",
                order.version,
                self.version,
                result.get("error"),
            )

    # ------------------------------------------------------ regression gate
    def observe_round(self, num_accepted: int) -> None:
        self.live_rounds.add(num_accepted + 1)
        if self.cfg.gate_window and self.live_rounds.rounds == self.cfg.gate_window:
            self._gate()

    def _gate(self) -> None:
        """Roll back when the live version's first `gate_window` rounds accept less
        than the previous version's last `gate_window` rounds before the swap, by
        more than `gate_margin` and beyond noise (`regressed`)."""
        base, cur = self.gate_baseline, self.live_rounds
        # A baseline needs enough rounds to mean something (half a window).
        too_short = base is None or 2 * len(base.recent) < self.cfg.gate_window
        if self.version == 0 or too_short:
            return
        if not regressed(base, cur, self.cfg.gate_margin):
            return
        bad = self.version
        reason = (
            f"live tau {cur.tau:.3f} < {base.tau:.3f} of version "
            f"{self.previous_good} before the swap, by more than "
            f"{self.cfg.gate_margin:.0%} and beyond noise"
        )
        mark_rejected(self.cfg.versions_dir, bad, f"rolled back: {reason}")
        self.counters.rollbacks += 1
        logger.warning("AdaFlash: rolling back drafter version %d: %s", bad, reason)
        target = self.previous_good
        info = read_version(self.cfg.versions_dir, target) if target else None
        path = str(info.path) if info else self.runtime.drafter
        self.pending = SwapOrder(target, path, None, reason="rollback")

    # ---------------------------------------------------------------- metrics
    def gauges(self) -> dict[str, float]:
        g: dict[str, float] = {
            "drafter_version": self.version,
            "swaps_total": self.counters.swaps,
            "swap_failures_total": self.counters.swap_failures,
            "rollbacks_total": self.counters.rollbacks,
            "swap_stall_ms": self.counters.last_swap_stall_ms,
            "requests_not_logged_total": self.counters.not_logged,
        }
        if self.writer is not None:
            c = self.writer.counters
            g.update(
                {
                    "buffer_records_written_total": c.written,
                    "buffer_records_dropped_total": c.dropped_full
                    + c.dropped_error
                    + self.counters.log_errors,
                    "buffer_bytes": c.bytes_on_disk,
                }
            )
        g.update(self._trainer_metrics())
        return g

    def gauges_if_due(self, fresh: bool = False) -> dict[str, float]:
        """`gauges()`, recomputed at most every 0.5 s, and after a swap's result
        (at every /metrics snapshot); `fresh`: now."""
        now = time.monotonic()
        if fresh or now - self._gauges_at >= 0.5:
            self._gauges, self._gauges_at = self.gauges(), now
        return self._gauges

    def _trainer_metrics(self) -> dict[str, float]:
        """Loss and clip fraction of the live version (read once per version)."""
        if self._metrics_version != self.version:
            self._metrics_version = self.version
            info = (
                read_version(self.cfg.versions_dir, self.version)
                if self.version
                else None
            )
            m = info.manifest.get("metrics", {}) if info is not None else {}
            self._metrics = {
                f"trainer_{k}": float(m[k])
                for k in ("loss", "clip_fraction", "ce", "rkl")
                if k in m
            }
        return self._metrics

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._trainer is not None and self._trainer.poll() is None:
            self._trainer.terminate()


def spawn_trainer(cfg: AdaFlashConfig, runtime: RuntimeInfo) -> subprocess.Popen:
    """Start `adaflash trainer` for this engine (its own process and cores)."""
    import msgspec

    run_dir = Path(runtime.run_dir or Path(runtime.stats_path).parent)
    config_path = run_dir / "trainer-config.json"
    config_path.write_text(
        json.dumps(
            {
                "method": "dflash",
                "model": runtime.drafter,
                "num_speculative_tokens": runtime.num_speculative_tokens,
                "adaflash": msgspec.to_builtins(cfg),
            }
        )
    )
    cores = cfg.online.trainer_cores
    # Pinned from the first import: the trainer's imports alone take seconds of
    # CPU, which must not land on the engine's cores.
    launcher = ["adaflash_vllm.pinned", ",".join(map(str, cores))] if cores else []
    cmd = [
        sys.executable,
        "-m",
        *launcher,
        "adaflash_vllm.cli",
        "trainer",
        "--config",
        str(config_path),
        "--target",
        runtime.target,
    ]
    log = open(run_dir / "trainer.log", "ab")  # noqa: SIM115  (lives with the child)
    logger.info("AdaFlash: spawning trainer (%s), log %s", " ".join(cmd), log.name)
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
