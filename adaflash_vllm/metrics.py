"""AdaFlash counters: kept in the engine core, served on vLLM's /metrics.

The scheduler (engine-core process) counts rounds in `RoundStats` and publishes a
JSON snapshot to a file now and then (atomic rename, so readers never see a torn
file). `AdaFlashCollector`, registered in the frontend's Prometheus registry,
reads the newest snapshot at scrape time. This keeps the hot loop free of IPC and
works for `vllm serve` (/metrics) and offline `LLM.get_metrics()` alike.

Metric names sit next to vLLM's `vllm:spec_decode_*` ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import msgspec
from vllm.logger import init_logger

logger = init_logger(__name__)


class RoundStats:
    """Cumulative counts over verification rounds (one round = one request in one
    decode step: k drafts verified, a accepted)."""

    def __init__(self, num_speculative_tokens: int):
        k = num_speculative_tokens
        self.num_speculative_tokens = k
        self.rounds = 0
        self.verified_tokens = 0  # sum of (1 + k_i)
        self.accepted_tokens = 0
        self.verified_hist = [0] * (k + 1)  # index n-1: rounds that verified n tokens
        self.drafted_per_pos = [0] * k
        self.accepted_per_pos = [0] * k
        # Rounds (and their 1 + k_i) of speculating steps: steps where some
        # request verified a draft. A step the draft gate skipped verifies none.
        self.speculative_rounds = 0
        self.speculative_verified_tokens = 0
        self.requests_finished = 0
        self.extra: dict[str, float] = {}  # gauges/counters other modules publish

    def observe_rounds(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One decode step's rounds: request i verified num_drafts[i] drafts and
        accepted num_accepted[i] of them."""
        k_max = self.num_speculative_tokens
        n, drafted = len(num_drafts), sum(num_drafts)
        self.rounds += n
        self.verified_tokens += n + drafted
        if not drafted:  # a step without drafts (the draft gate skipped it)
            self.verified_hist[0] += n
            return
        self.accepted_tokens += sum(num_accepted)
        self.speculative_rounds += n  # some request verified a draft
        self.speculative_verified_tokens += n + drafted
        for k, a in zip(num_drafts, num_accepted, strict=True):
            self.verified_hist[min(k, k_max)] += 1
            for j in range(min(k, k_max)):
                self.drafted_per_pos[j] += 1
            for j in range(min(a, k_max)):
                self.accepted_per_pos[j] += 1

    def observe_rounds_without_drafts(self, n: int) -> None:
        """`observe_rounds` for n rounds that verified no draft."""
        self.rounds += n
        self.verified_tokens += n
        self.verified_hist[0] += n

    def snapshot(self) -> dict[str, Any]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "rounds": self.rounds,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verified_hist": list(self.verified_hist),
            "drafted_per_pos": list(self.drafted_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
            "speculative_rounds": self.speculative_rounds,
            "speculative_verified_tokens": self.speculative_verified_tokens,
            "requests_finished": self.requests_finished,
            "extra": dict(self.extra),
            "time": time.time(),
        }


# numpy scalars among the gauges: as Python numbers.
_ENCODER = msgspec.json.Encoder(enc_hook=lambda x: x.item())


class StatsPublisher:
    """Writes `RoundStats` snapshots to `path` at most every `interval_s` seconds."""

    def __init__(self, path: str, interval_s: float):
        self.path = path
        self.interval_s = interval_s
        self._last = 0.0
        self._failed = False

    def due(self, *, force: bool = False) -> bool:
        """Whether a snapshot is due now (`interval_s` since the last, or forced)."""
        return force or time.monotonic() - self._last >= self.interval_s

    def maybe_publish(self, stats: RoundStats, *, force: bool = False) -> None:
        if self.due(force=force):
            self.publish(stats)

    def publish(self, stats: RoundStats) -> None:
        self._last = time.monotonic()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_ENCODER.encode(stats.snapshot()))
            os.replace(tmp, self.path)
            self._failed = False
        except OSError as e:  # full disk, removed dir: metrics stall, serving goes on
            # (a folder the frontend removed as it exited: nobody is reading)
            gone = not os.path.isdir(os.path.dirname(self.path))
            if not self._failed and not gone:
                logger.warning("AdaFlash: cannot publish metrics to %s: %s", tmp, e)
            self._failed = True


def read_snapshot(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class AdaFlashCollector:
    """Prometheus collector that exposes the engine core's latest snapshot."""

    def __init__(self, path: str, model_name: str = ""):
        self.path = path
        self.labels = {"model_name": model_name} if model_name else {}

    def describe(self):  # no eager collect() at registration time
        return []

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snap = read_snapshot(self.path)
        if snap is None:
            return
        names = list(self.labels)
        values = list(self.labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        yield counter(
            "vllm:adaflash_rounds",
            "Verification rounds (request x decode step).",
            snap["rounds"],
        )
        yield counter(
            "vllm:adaflash_verified_tokens",
            "Tokens the target verified (1 + drafts per round).",
            snap["verified_tokens"],
        )
        yield counter(
            "vllm:adaflash_accepted_tokens",
            "Draft tokens accepted.",
            snap["accepted_tokens"],
        )
        yield counter(
            "vllm:adaflash_speculative_rounds",
            "Rounds of decode steps where some request verified a draft.",
            snap.get("speculative_rounds", 0),
        )
        yield counter(
            "vllm:adaflash_speculative_verified_tokens",
            "Tokens the target verified in those rounds.",
            snap.get("speculative_verified_tokens", 0),
        )
        yield counter(
            "vllm:adaflash_requests_finished",
            "Requests finished under AdaFlash.",
            snap["requests_finished"],
        )
        for name, doc, per_pos in (
            (
                "vllm:adaflash_drafted_tokens_per_pos",
                "Rounds that verified a draft at this position.",
                "drafted_per_pos",
            ),
            (
                "vllm:adaflash_accepted_tokens_per_pos",
                "Rounds that accepted the draft at this position.",
                "accepted_per_pos",
            ),
        ):
            m = CounterMetricFamily(name, doc, labels=[*names, "position"])
            for pos, v in enumerate(snap[per_pos]):
                m.add_metric([*values, str(pos)], v)
            yield m
        hist = snap["verified_hist"]
        buckets, acc = [], 0
        for n, count in enumerate(hist, start=1):
            acc += count
            buckets.append((str(float(n)), acc))
        buckets.append(("+Inf", acc))
        h = HistogramMetricFamily(
            "vllm:adaflash_verify_length",
            "Tokens verified per round (1 + k_i).",
            labels=names,
        )
        h.add_metric(values, buckets, sum_value=snap["verified_tokens"])
        yield h
        for key, value in sorted(snap.get("extra", {}).items()):
            g = GaugeMetricFamily(
                f"vllm:adaflash_{key}", f"AdaFlash {key}.", labels=names
            )
            g.add_metric(values, value)
            yield g


_REGISTERED: dict[str, AdaFlashCollector] = {}


def register_collector(path: str, model_name: str = "") -> None:
    """Expose the snapshot at `path` in this process's Prometheus registry."""
    from prometheus_client import REGISTRY

    for old in list(_REGISTERED.values()):  # one engine per process at a time
        with contextlib.suppress(KeyError):
            REGISTRY.unregister(old)
    _REGISTERED.clear()
    collector = AdaFlashCollector(path, model_name)
    REGISTRY.register(collector)
    _REGISTERED[path] = collector
