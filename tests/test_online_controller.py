"""The engine-side online controller without an engine: version discovery, swap
bookkeeping, rejection, and the regression gate's automatic rollback."""

import json
import time

import torch

from adaflash_vllm.config import AdaFlashConfig, OnlineConfig, RuntimeInfo
from adaflash_vllm.online_engine import HEARTBEAT, OnlineController
from adaflash_vllm.versions import publish_version, rejected_versions


def _controller(tmp_path, **online) -> OnlineController:
    cfg = AdaFlashConfig(
        online=OnlineConfig(
            enabled=True,
            buffer_dir=str(tmp_path / "buf"),
            versions_dir=str(tmp_path / "ver"),
            poll_interval_s=0.0,
            **online,
        )
    )
    runtime = RuntimeInfo(
        num_speculative_tokens=3,
        stats_path=str(tmp_path / "s.json"),
        target="t",
        drafter=str(tmp_path / "v0"),
    )
    return OnlineController(cfg, runtime)


def _publish(tmp_path, version: int) -> None:
    publish_version(
        tmp_path / "ver",
        version,
        {"dflash_config": {}},
        {"w": torch.ones(2)},
        {"metrics": {"loss": 1.5, "clip_fraction": 0.1}},
    )


def _swap(ctl: OnlineController, ok: bool = True, error: str = "") -> None:
    ctl.poll()
    order = ctl.take_order()
    assert order is not None
    ctl.on_swap_result(
        {
            "ok": ok,
            "version": order.version,
            "stall_s": 0.01,
            "via": "folder",
            "error": error,
        }
    )


def test_new_version_is_ordered_once_and_recorded(tmp_path):
    ctl = _controller(tmp_path)
    ctl.poll()
    assert ctl.take_order() is None  # nothing published yet
    _publish(tmp_path, 1)
    _swap(ctl)
    assert ctl.version == 1 and ctl.counters.swaps == 1
    ctl.poll()
    assert ctl.take_order() is None
    g = ctl.gauges()
    assert g["drafter_version"] == 1 and g["trainer_loss"] == 1.5


def test_pending_fetch_is_ordered_again_until_applied(tmp_path):
    """Workers fetch in the background and answer "pending": the same version is
    ordered again next step, a newer one replaces it, nothing counts as a swap or
    a failure until a worker applies it."""
    ctl = _controller(tmp_path)
    _publish(tmp_path, 1)
    ctl.poll()
    order = ctl.take_order()
    ctl.on_swap_result({"ok": False, "pending": True, "version": 1, "stall_s": 0})
    assert ctl.version == 0 and ctl.counters.swaps == ctl.counters.swap_failures == 0
    _publish(tmp_path, 2)
    ctl.poll()  # version 2 replaces the pending order for 1
    again = ctl.take_order()
    assert order.version == 1 and again.version == 2
    ctl.on_swap_result({"ok": True, "version": 2, "stall_s": 0.001, "via": "push"})
    assert ctl.version == 2 and ctl.counters.swaps == 1
    assert ctl.counters.last_swap_stall_ms == 1.0


def test_push_info_only_with_a_fresh_trainer_heartbeat(tmp_path):
    ctl = _controller(tmp_path)
    _publish(tmp_path, 1)
    beat = {"session": "s", "host": "127.0.0.1", "port": 1234, "time": time.time()}
    (tmp_path / "ver" / HEARTBEAT).write_text(json.dumps(beat))
    ctl.poll()
    assert ctl.take_order().push == {"host": "127.0.0.1", "port": 1234, "session": "s"}
    ctl.on_swap_result({"ok": True, "version": 1})
    _publish(tmp_path, 2)
    beat["time"] -= 60  # a dead trainer: load from the folder, never wait on it
    (tmp_path / "ver" / HEARTBEAT).write_text(json.dumps(beat))
    ctl.poll()
    assert ctl.take_order().push is None


def test_rejected_version_is_marked_and_skipped(tmp_path):
    ctl = _controller(tmp_path)
    _publish(tmp_path, 1)
    _swap(ctl, ok=False, error="fc.weight: NaN or inf values")
    assert ctl.version == 0 and 1 in rejected_versions(tmp_path / "ver")
    ctl.poll()
    assert ctl.take_order() is None


def test_regression_gate_rolls_back_a_worse_version(tmp_path):
    """v2 accepts far less than v1 over the gate window: the engine goes back to v1
    and marks v2 rejected, so neither it nor a restarted engine uses v2 again."""
    ctl = _controller(tmp_path, gate_window=50, gate_margin=0.05)
    _publish(tmp_path, 1)
    _swap(ctl)
    for _ in range(60):
        ctl.observe_round(2)  # tau 3.0
    _publish(tmp_path, 2)
    _swap(ctl)
    for _ in range(50):
        ctl.observe_round(1)  # tau 2.0 < 3.0 * 0.95
    order = ctl.take_order()
    assert order is not None and order.reason == "rollback" and order.version == 1
    assert "rolled back" in rejected_versions(tmp_path / "ver")[2]
    ctl.on_swap_result({"ok": True, "version": 1})
    assert ctl.version == 1 and ctl.counters.rollbacks == 1


def test_no_rollback_within_margin(tmp_path):
    ctl = _controller(tmp_path, gate_window=40, gate_margin=0.2)
    _publish(tmp_path, 1)
    _swap(ctl)
    for _ in range(40):
        ctl.observe_round(2)
    _publish(tmp_path, 2)
    _swap(ctl)
    for i in range(40):
        ctl.observe_round(2 if i % 4 else 1)  # tau 2.75 >= 3.0 * 0.8
    assert ctl.pending is None and ctl.counters.rollbacks == 0


def test_gate_baseline_is_the_traffic_just_before_the_swap(tmp_path):
    """Traffic turned harder while v1 was live (e.g. prose -> math): v2 matches what
    v1 did on that traffic, so it stays, though v1's lifetime tau was far higher."""
    ctl = _controller(tmp_path, gate_window=100, gate_margin=0.05)
    _publish(tmp_path, 1)
    _swap(ctl)
    for _ in range(300):
        ctl.observe_round(2)  # easy traffic: tau 3.0
    for _ in range(100):
        ctl.observe_round(0)  # hard traffic: tau 1.0
    _publish(tmp_path, 2)
    _swap(ctl)
    for _ in range(100):
        ctl.observe_round(0)
    assert ctl.pending is None and ctl.counters.rollbacks == 0


def test_gate_ignores_a_gap_within_noise(tmp_path):
    """A 16% lower mean over 40 very noisy rounds (gap 0.7, 2 standard errors 1.5)
    is not evidence of a regression."""
    ctl = _controller(tmp_path, gate_window=40, gate_margin=0.05)
    _publish(tmp_path, 1)
    _swap(ctl)
    for i in range(40):
        ctl.observe_round(7 if i % 2 else 0)  # tau 4.5, sd 3.5
    _publish(tmp_path, 2)
    _swap(ctl)
    for i in range(40):
        ctl.observe_round(7 if i % 5 in (1, 3) else 0)  # tau 3.8: 16% lower
    assert ctl.pending is None and ctl.counters.rollbacks == 0


def test_restart_resumes_from_newest_good(tmp_path):
    _publish(tmp_path, 1)
    _publish(tmp_path, 2)
    from adaflash_vllm.versions import mark_rejected

    mark_rejected(tmp_path / "ver", 2, "test")
    ctl = _controller(tmp_path)
    order = ctl.take_order()
    assert order.version == 1 and order.reason == "resume"


def test_pinned_launcher_pins_before_the_module_runs(tmp_path):
    """The spawned trainer runs on its own cores from its first import on."""
    import os
    import subprocess
    import sys

    (tmp_path / "show_cores.py").write_text(
        "import os, sys\nprint(sorted(os.sched_getaffinity(0)), sys.argv[1:])\n"
    )
    core = min(os.sched_getaffinity(0))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaflash_vllm.pinned",
            str(core),
            "show_cores",
            "--x",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    ).stdout
    assert out.strip() == f"[{core}] ['--x', '1']"
