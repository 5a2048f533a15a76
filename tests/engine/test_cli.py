"""The vLLM command line with adaflash.json: `vllm bench throughput` runs AdaFlash,
and a bad config stops `vllm serve` with one clear line (no traceback)."""

import json
import subprocess

import pytest

from adaflash_vllm.serve_process import vllm_executable

pytestmark = pytest.mark.engine

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]


def test_vllm_bench_throughput_with_config_file(tiny):
    """`vllm bench throughput --speculative-config FILE` runs with AdaFlash on."""
    config = tiny.write_config("bench-throughput.json", tiny.spec(adaflash={}))
    cmd = [
        *vllm_executable(),
        "bench",
        "throughput",
        "--model",
        str(tiny.target),
        "--speculative-config",
        str(config),
        "--dataset-name",
        "random",
        "--num-prompts",
        "8",
        "--random-input-len",
        "16",
        "--random-output-len",
        "16",
        *ENGINE_ARGS,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "Throughput:" in out
    assert "AdaFlash scheduler active" in out


@pytest.mark.parametrize(
    "section, message",
    [
        ({"lenght": {}}, "AdaFlash error: unknown key `adaflash.lenght`"),
        ({"length": {"mode": "sometimes"}}, "AdaFlash error: invalid adaflash config"),
    ],
)
def test_bad_config_exits_with_one_clear_line(tiny, section, message):
    config = tiny.write_config("bad.json", tiny.spec(adaflash=section))
    run = subprocess.run(
        [
            *vllm_executable(),
            "serve",
            str(tiny.target),
            "--speculative-config",
            str(config),
            *ENGINE_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert message in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def test_missing_config_file_is_an_argparse_error(tiny, tmp_path):
    run = subprocess.run(
        [
            *vllm_executable(),
            "serve",
            str(tiny.target),
            "--speculative-config",
            str(tmp_path / "nope.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 2
    assert "speculative config file not found" in out and "Traceback" not in out


def test_inline_json_still_accepted(tiny):
    """Inline JSON keeps working (vLLM's own form), checked up to the drafter load."""
    spec = json.dumps(tiny.spec(adaflash={}, model="/nonexistent/drafter"))
    run = subprocess.run(
        [
            *vllm_executable(),
            "serve",
            str(tiny.target),
            "--speculative-config",
            spec,
            *ENGINE_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert "AdaFlash error: drafter not found: '/nonexistent/drafter'" in out
