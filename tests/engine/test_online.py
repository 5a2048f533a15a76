"""Online distillation end to end: the real engine logs what it serves, a real
trainer process distils and pushes over a real gloo group, the engine swaps between
steps, stays lossless, never touches the target, survives a killed trainer, rejects
bad versions, rolls back regressions and resumes after a restart."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from adaflash_vllm.training.checkpoint import load_drafter

from adaflash_vllm.serve_process import free_port
from adaflash_vllm.versions import (
    latest_version,
    newest_good_version,
    publish_version,
    rejected_versions,
)
from tests.helpers import PROMPTS, greedy, make_llm, metrics, shutdown

pytestmark = pytest.mark.engine

K = 3
STREAM = PROMPTS[:16]


def _acceptance(before: dict, after: dict) -> float:
    rounds = after["vllm:adaflash_rounds"] - before["vllm:adaflash_rounds"]
    acc = (
        after["vllm:adaflash_accepted_tokens"] - before["vllm:adaflash_accepted_tokens"]
    )
    return acc / max(1, rounds)


@pytest.fixture(scope="module")
def online(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    spec = tiny.spec(
        k=K,
        adaflash={
            "online": {
                "enabled": True,
                "buffer_dir": str(root / "buffer"),
                "versions_dir": str(root / "versions"),
                "train_every": 16,
                "num_anchors": 8,
                "poll_interval_s": 0.1,
                "push_port": free_port(),
                "gate_window": 0,
            }
        },
    )
    config = root / "adaflash.json"
    config.write_text(json.dumps(spec))
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adaflash_vllm.cli",
            "trainer",
            "--config",
            str(config),
            "--target",
            str(tiny.target),
        ],
        stdout=open(root / "trainer.log", "wb"),  # noqa: SIM115 (lives with the child)
        stderr=subprocess.STDOUT,
    )
    llm = make_llm(tiny.target, str(config))
    state = {
        "root": root,
        "config": config,
        "spec": spec,
        "llm": llm,
        "trainer": trainer,
        "versions": root / "versions",
        "target_checksum": llm.collective_rpc("adaflash_checksums")[0]["target"],
    }
    yield state
    if trainer.poll() is None:
        trainer.kill()
    if state["llm"] is not None:
        shutdown(state["llm"])


def test_serving_trains_swaps_and_raises_acceptance(online, baseline):
    """Repeated traffic: versions get published and swapped in, accepted drafts per
    round rise, and every output stays token-identical to plain vLLM."""
    llm = online["llm"]
    first = last = None
    deadline = time.monotonic() + 240
    rounds = 0
    while time.monotonic() < deadline:
        before = metrics(llm)
        outs = greedy(llm, STREAM)
        assert outs == baseline["greedy"][: len(STREAM)], f"diverged in round {rounds}"
        rate = _acceptance(before, metrics(llm))
        first = rate if first is None else first
        last = rate
        rounds += 1
        if metrics(llm)["vllm:adaflash_drafter_version"] >= 4 and rounds >= 6:
            break
        time.sleep(1.0)
    m = metrics(llm)
    assert m["vllm:adaflash_swaps_total"] >= 3, m
    assert m["vllm:adaflash_buffer_records_written_total"] >= 48
    assert "vllm:adaflash_trainer_loss" in m
    assert last > first * 1.2, f"accepted/round {first:.3f} -> {last:.3f}"
    log = (online["root"] / "trainer.log").read_text()
    assert '"event": "published"' in log


def test_trainer_killed_mid_run_server_keeps_answering(online, baseline):
    """SIGKILL the trainer while requests are in flight: all of them complete."""
    llm, trainer = online["llm"], online["trainer"]
    results = {}

    def serve():
        results["outs"] = greedy(llm, PROMPTS)

    t = threading.Thread(target=serve)
    t.start()
    time.sleep(0.3)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(30)
    t.join(120)
    assert results["outs"] == baseline["greedy"]
    assert greedy(llm, PROMPTS[:4]) == baseline["greedy"][:4]


def _publish_variant(online, change) -> int:
    good = newest_good_version(online["versions"])
    cfg, state = load_drafter(good.path)
    version = latest_version(online["versions"]) + 1
    publish_version(online["versions"], version, cfg, change(state), {"test": True})
    return version


def _serve_until(llm, baseline, done, timeout_s: float = 90.0) -> None:
    """Serve (losslessly) until `done()`: swaps are fetched in the background and
    only advance while steps run (a fetch from a trainer that just died waits out
    push_timeout_s before the folder is read)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        assert greedy(llm, PROMPTS[:2], max_tokens=8) == [
            b[:8] for b in baseline["greedy"][:2]
        ]


def test_nan_and_wrong_shape_versions_rejected(online, baseline):
    """A published version with NaN or a wrong shape is refused; the engine keeps
    the last good drafter and keeps serving losslessly."""
    llm = online["llm"]
    good = newest_good_version(online["versions"])
    _serve_until(  # every good version published so far is live
        llm,
        baseline,
        lambda: metrics(llm)["vllm:adaflash_drafter_version"] == good.version,
    )
    live = good.version

    def nan(state):
        state["norm.weight"] = state["norm.weight"] * float("nan")
        return state

    def shape(state):
        state["fc.weight"] = state["fc.weight"][:, :-1]
        return state

    for change in (nan, shape):
        bad = _publish_variant(online, change)
        time.sleep(0.3)
        assert greedy(llm, PROMPTS[:8]) == baseline["greedy"][:8]
        _serve_until(
            llm, baseline, lambda bad=bad: bad in rejected_versions(online["versions"])
        )
        assert metrics(llm)["vllm:adaflash_drafter_version"] == live
    _serve_until(  # gauges are published at intervals
        llm,
        baseline,
        lambda: metrics(llm)["vllm:adaflash_swap_failures_total"] >= 2,
        timeout_s=30.0,
    )
    assert metrics(llm)["vllm:adaflash_drafter_version"] == live


def test_target_bit_identical_after_swaps(online):
    checks = online["llm"].collective_rpc("adaflash_checksums")[0]
    assert checks["target"] == online["target_checksum"]


def _draft_logits(llm, prompts) -> list:
    llm.reset_prefix_cache()
    llm.collective_rpc("adaflash_capture_drafts", args=(True,))
    greedy(llm, prompts, max_tokens=8)
    caps = llm.collective_rpc("adaflash_take_captures")[0]
    llm.collective_rpc("adaflash_capture_drafts", args=(False,))
    return sorted(
        (c["bonus_positions"][i], c["bonus_token_ids"][i], c["logits"][i])
        for c in caps
        for i in range(len(c["req_ids"]))
    )


def assert_drafts_equal_fresh_engine(
    tiny, checkpoint, prompts, got: list, *, same_argmax: bool = False
) -> None:
    """`got` (from `_draft_logits`) equals the drafts of a fresh engine started
    directly on `checkpoint`: same positions and bonus tokens, logits within 1e-4
    (and, with `same_argmax`, the same top draft at every slot)."""
    fresh = make_llm(tiny.target, tiny.spec(k=K, adaflash={}, model=str(checkpoint)))
    try:
        direct = _draft_logits(fresh, prompts)
    finally:
        shutdown(fresh)
    assert len(got) == len(direct) > 0
    for (pos_a, tok_a, la), (pos_b, tok_b, lb) in zip(got, direct, strict=True):
        assert (pos_a, tok_a) == (pos_b, tok_b)
        a, b = torch.tensor(la), torch.tensor(lb)
        if same_argmax:
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_restart_resumes_newest_good_version_equal_to_fresh_engine(online, tiny):
    """A restarted engine resumes from the newest good version, and its drafts equal
    those of a fresh engine started directly on that published checkpoint."""
    shutdown(online["llm"])
    online["llm"] = None
    good = newest_good_version(online["versions"])
    assert good is not None and good.version >= 1
    prompts = PROMPTS[20:24]
    restarted = make_llm(tiny.target, str(online["config"]))
    try:
        greedy(restarted, prompts[:1], max_tokens=4)  # first step applies the resume
        assert metrics(restarted)["vllm:adaflash_drafter_version"] == good.version
        resumed = _draft_logits(restarted, prompts)
    finally:
        shutdown(restarted)
    assert_drafts_equal_fresh_engine(
        tiny, good.path, prompts, resumed, same_argmax=True
    )
