"""The README's main job, `adaflash demo`, at its smallest size, end to end on the
bundled demo models (plain vLLM before and after stock DFlash and AdaFlash with
online training), the stream refilled as served traffic is."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_demo_small_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaflash_vllm.cli",
            "demo",
            "--size",
            "small",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    # plain runs before and after the others; the ratios are against their mean
    assert set(summary) == {"plain", "dflash", "adaflash", "plain#2"}
    for config in summary.values():
        assert set(config) == {"prose", "math", "code"}
        assert all(phase["tok_s"] > 0 for phase in config.values())
        assert all(phase["requests"] == 8 for phase in config.values())
    plain = [summary[n]["prose"]["speedup"] for n in ("plain", "plain#2")]
    assert sum(plain) == pytest.approx(2.0)
    assert summary["dflash"]["prose"]["tau"] > 1.5  # the drafter works in domain
    # the refilled stream counts each request's drafts: stock DFlash verifies K + 1
    assert summary["dflash"]["math"]["verify_len"] == pytest.approx(8.0)
    assert summary["plain"]["code"]["verify_len"] == 1.0
    assert (out / "shift.png").stat().st_size > 5000
    assert "| adaflash | code |" in (out / "report.md").read_text()
    # AdaFlash spawned its online trainer (at this size the run can end before the
    # trainer has imported torch; the trainer itself is tested in test_online.py).
    assert "AdaFlash: spawning trainer" in (out / "adaflash.log").read_text()
