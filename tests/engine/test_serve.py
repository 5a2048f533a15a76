"""`vllm serve` with `--speculative-config adaflash.json`, driven by real HTTP
clients (the official openai client, /metrics, `vllm bench serve`)."""

import json
import subprocess

import pytest

from adaflash_vllm.serve_process import (
    ServeProcess,
    metric_sum,
    parse_prometheus,
    vllm_executable,
)
from tests.helpers import PROMPTS

pytestmark = [pytest.mark.engine, pytest.mark.server]

SERVE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--enforce-eager",
    "--max-num-seqs",
    "8",
    "--seed",
    "0",
]


@pytest.fixture(scope="module")
def server(tiny):
    config = tiny.write_config(
        "serve-adaflash.json", tiny.spec(adaflash={"length": {"mode": "debug_ragged"}})
    )
    with ServeProcess(
        [str(tiny.target), "--speculative-config", str(config), *SERVE_ARGS]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none")


def _counts(server) -> dict[str, float]:
    values = parse_prometheus(server.metrics_text())
    names = [
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:adaflash_rounds_total",
        "vllm:adaflash_verified_tokens_total",
        "vllm:adaflash_drafted_tokens_per_pos_total",
    ]
    return {n: metric_sum(values, n) for n in names}


def test_completions_chat_and_stream_with_metrics_moving(server, client, tiny):
    """Completions, chat completions and a stream all work; spec-decode and AdaFlash
    counters on /metrics grow with the traffic."""
    before = _counts(server)
    model = str(tiny.target)
    done = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    assert done.choices[0].text and done.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True
        )
    ]
    assert len(pieces) > 1 and "".join(pieces)
    after = _counts(server)
    for name, value in after.items():
        assert value > before[name], f"{name} did not move: {before[name]} -> {value}"


def test_greedy_server_output_matches_offline_baseline(server, client, tiny, baseline):
    """The served tokens equal plain vLLM's greedy continuation."""
    for i in (3, 4):
        got = client.completions.create(
            model=str(tiny.target),
            prompt=PROMPTS[i],
            max_tokens=32,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert got.choices[0].token_ids == baseline["greedy"][i]


def test_vllm_bench_serve_reports_acceptance_length(server, tiny, tmp_path):
    """`vllm bench serve --dataset-name custom` runs against the server and reports
    an acceptance length."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:12]))
    cmd = [
        *vllm_executable(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--model",
        str(tiny.target),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "12",
        "--custom-output-len",
        "16",
        "--skip-chat-template",
        "--temperature",
        "0",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "bench.json",
        "--max-concurrency",
        "4",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 12
    assert result["spec_decode_acceptance_length"] >= 1.0
