"""The benchmark result schema (one JSON file per configuration run) and helpers.

Schema `adaflash-bench/1` (docs/BENCHMARKS.md describes every field):

    {"schema", "created", "git_sha", "command", "machine": {...},
     "setup": {target, drafter, num_speculative_tokens, adaflash_config},
     "workload": {kind, phases: [{name, count}], window, concurrencies, max_tokens,
                  temperature},
     "config": {name, speculative_config}, "status": "ok" | "failed", "error",
     "points": [Point, ...]}

A Point is one window of a shift stream (`key` = window index) or one concurrency
of a sweep (`key` = concurrency). Speed fields are medians over repeats, with the
per-repeat values kept in `tok_s_runs`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "adaflash-bench/1"


@dataclass
class Point:
    key: int  # window index (shift) or concurrency (sweep)
    phase: str
    requests: int
    output_tokens: int
    wall_s: float
    tok_s: float  # output tokens per second (median over repeats)
    tok_s_runs: list[float] = field(default_factory=list)
    tau: float | None = None  # mean tokens per target step (accepted + bonus)
    verify_len: float | None = None  # mean tokens verified per round (1 + k_i)
    # The same two over speculating steps (some request verified a draft).
    tau_speculative: float | None = None
    verify_len_speculative: float | None = None
    rounds: int = 0
    accept_per_pos: list[float] = field(default_factory=list)
    ttft_ms_p50: float | None = None
    tpot_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    failed_requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    try:
        with open("/proc/cpuinfo") as f:
            names = [
                ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")
            ]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    return info


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def new_result(*, command: str, setup: dict, workload: dict, config: dict) -> dict:
    """A result record for one configuration. `workload` is the workload as JSON;
    its phases are recorded by name and counts, without the prompts."""
    workload = workload | {
        "phases": [
            {
                "name": p["name"],
                "count": len(p["prompts"]),
                "skipped": p["skipped"],
                "repeated": p["repeated"],
            }
            for p in workload["phases"]
        ]
    }
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": git_sha(),
        "command": command,
        "machine": machine_info(),
        "setup": setup,
        "workload": workload,
        "config": config,
        "status": "running",
        "error": None,
        "points": [],
    }


def add_point(result: dict, point: Point) -> None:
    result["points"].append(asdict(point))


def save_result(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def load_results(folder: str | Path) -> list[dict]:
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if data.get("schema") == SCHEMA:
            out.append(data)
    return sorted(out, key=lambda r: r.get("created", ""))  # the order they ran in


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def online_history(versions_dir: str | Path) -> list[dict[str, Any]]:
    """Every drafter version the online trainer published in `versions_dir`, in
    order: its manifest metrics (loss, CE, reverse-KL, clip fraction, acceptance
    before/after training, seconds) and, for versions the engine refused or rolled
    back, why."""
    from adaflash_vllm.versions import latest_version, read_version, rejected_versions

    rejected = rejected_versions(versions_dir)
    history = []
    for v in range(1, latest_version(versions_dir) + 1):
        info = read_version(versions_dir, v)
        if info is None:
            continue
        history.append(
            {
                "version": v,
                "created": info.manifest.get("created"),
                "metrics": info.manifest.get("metrics", {}),
                "rejected": rejected.get(v),
            }
        )
    return history
