"""The benchmark harness end to end on the tiny models: a shift stream (offline
engines) and a concurrency sweep (real `vllm serve` + HTTP client) produce
well-formed JSON, Markdown and PNG; bad inputs fail clearly."""

import json

import pytest

from adaflash_vllm.bench.configs import BenchSetup, build_config
from adaflash_vllm.bench.harness import rebuild_report, run_benchmark
from adaflash_vllm.bench.results import SCHEMA
from adaflash_vllm.bench.workloads import Workload, load_phase, output_lengths
from adaflash_vllm.errors import AdaFlashConfigError
from adaflash_vllm.serve_process import ServeProcess, ServerStartError
from tests.helpers import PROMPTS

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.target)


def _setup(tiny) -> BenchSetup:
    return BenchSetup(
        target=str(tiny.target),
        drafter=str(tiny.drafter_trained),
        num_speculative_tokens=3,
    )


def _check_outputs(out, results_names, kind):
    for name in results_names:
        data = json.loads((out / f"{name.replace(':', '-')}.json").read_text())
        assert data["schema"] == SCHEMA and data["status"] == "ok", data.get("error")
        assert data["points"] and all(p["tok_s"] > 0 for p in data["points"])
        assert data["machine"]["cpu_count"] and data["git_sha"]
        assert data["workload"]["kind"] == kind
    report = (out / "report.md").read_text()
    assert "| config |" in report and "speedup vs plain" in report
    for png in out.glob("*.png"):
        assert (
            png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        )


def test_shift_stream_offline(tiny, tokenizer, prompt_file, tmp_path):
    phases = [
        load_phase(str(prompt_file), tokenizer, count=4),
        load_phase(str(prompt_file), tokenizer, count=4, offset=8),
    ]
    workload = Workload("shift", phases, window=2, max_tokens=12)
    names = ["plain", "adaflash:debug_ragged"]
    summary = run_benchmark(
        setup=_setup(tiny),
        config_names=names,
        workload=workload,
        out_dir=tmp_path,
        driver="offline",
        command="test",
    )
    _check_outputs(tmp_path, names, "shift")
    assert (tmp_path / "shift.png").exists() and summary["failed"] == []
    ada = summary["summary"]["adaflash:debug_ragged"]["prompts"]
    assert ada["verify_len"] < 4.0  # ragged budgets: fewer than 1 + K on average
    # Speculating steps' counters come through LLM.get_metrics(): over them tau
    # and verify length are at least those over every round.
    for p in json.loads((tmp_path / "adaflash-debug_ragged.json").read_text())[
        "points"
    ]:
        assert p["tau_speculative"] >= p["tau"] - 1e-9
        assert p["verify_len_speculative"] >= p["verify_len"] - 1e-9
    # a re-plot from the JSON files alone gives the same table
    assert rebuild_report(tmp_path)["summary"] == summary["summary"]


def test_concurrency_sweep_offline(tiny, tokenizer, prompt_file, tmp_path):
    """The offline driver's sweep: every configuration's engine up at once in
    its own process, their passes in turn; each level's requests (2 per slot)
    with that many in flight, every request its own drawn length. An engine
    that cannot start is reported failed and the others still run."""
    workload = Workload(
        "sweep",
        [load_phase(str(prompt_file), tokenizer, count=8)],
        concurrencies=(1, 4),
        max_tokens=12,
        requests_per_slot=2,
        output_len_spread=0.5,
    )
    bad = tmp_path / "bad-adaflash.json"
    bad.write_text(json.dumps({"adaflash": {"no_such_key": 1}}))
    names = ["plain", "adaflash:cost_aware"]
    summary = run_benchmark(
        setup=_setup(tiny),
        config_names=[names[0], f"bad@{bad}", names[1]],
        workload=workload,
        out_dir=tmp_path,
        driver="offline",
        repeats=2,
        command="test",
    )
    _check_outputs(tmp_path, names, "sweep")
    assert summary["failed"] == ["bad"]
    failed = json.loads((tmp_path / "bad.json").read_text())
    assert failed["status"] == "failed" and "exited" in failed["error"]
    assert "no_such_key" in (tmp_path / "bad.log").read_text()
    for name in names:
        points = json.loads((tmp_path / f"{name.replace(':', '-')}.json").read_text())[
            "points"
        ]
        assert [p["key"] for p in points] == [1, 4]
        assert [p["requests"] for p in points] == [2, 8]
        assert [p["output_tokens"] for p in points] == [
            sum(output_lengths(n, 12, 0.5)) for n in (2, 8)
        ]
        assert all(len(p["tok_s_runs"]) == 2 for p in points)
    ada = json.loads((tmp_path / "adaflash-cost_aware.json").read_text())["points"]
    assert all(0.0 <= p["extra"]["gate_skipped_share"] <= 1.0 for p in ada)
    assert ada[0]["rounds"] > 0  # AdaFlash's counters came through get_metrics()


def test_concurrency_sweep_served(tiny, tokenizer, prompt_file, tmp_path):
    """All servers up at once, measured in turn; one that cannot start is reported
    failed and the others still run. AdaFlash's draft-gate counters come through
    `vllm serve`'s /metrics into each point."""
    workload = Workload(
        "sweep",
        [load_phase(str(prompt_file), tokenizer, count=8)],
        concurrencies=(1, 4),
        max_tokens=12,
        requests_per_slot=3,
        output_len_spread=0.5,  # 6 to 18 tokens per request
    )
    bad = tmp_path / "bad-adaflash.json"
    bad.write_text(json.dumps({"adaflash": {"no_such_key": 1}}))
    names = ["plain", "dflash", "adaflash:cost_aware"]
    summary = run_benchmark(
        setup=_setup(tiny),
        config_names=[*names, f"bad@{bad}"],
        workload=workload,
        out_dir=tmp_path,
        driver="serve",
        repeats=2,
        command="test",
    )
    _check_outputs(tmp_path, names, "sweep")
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert [p["requests"] for p in plain["points"]] == [8, 12]  # >= 8, 3 per slot
    # every request asked for its own length (ignore_eos: it gets exactly that)
    assert [p["output_tokens"] for p in plain["points"]] == [
        sum(output_lengths(n, 12, 0.5)) for n in (8, 12)
    ]
    assert summary["failed"] == ["bad"]
    assert json.loads((tmp_path / "bad.json").read_text())["status"] == "failed"
    assert (
        len(
            json.loads((tmp_path / "plain.json").read_text())["points"][0]["tok_s_runs"]
        )
        == 2
    )
    point = json.loads((tmp_path / "dflash.json").read_text())["points"][0]
    assert point["ttft_ms_p50"] > 0 and point["failed_requests"] == 0
    assert point["tau"] > 1.0  # spec-decode counters scraped from /metrics
    assert set(summary["summary"]["dflash"]) == {"1", "4"}
    ada = json.loads((tmp_path / "adaflash-cost_aware.json").read_text())["points"]
    assert all(0.0 <= p["extra"]["gate_skipped_share"] <= 1.0 for p in ada)
    # Stock DFlash speculates in every step. AdaFlash's speculating-step counters
    # come through /metrics: the gate starts drafting, and a speculating step
    # verifies at least one draft for some request.
    assert point["tau_speculative"] == point["tau"]
    assert ada[0]["verify_len_speculative"] > 1.0
    for p in ada:
        if p["verify_len_speculative"] is not None:
            assert p["verify_len_speculative"] >= p["verify_len"]
            assert p["tau_speculative"] >= p["tau"]


def test_shift_stream_served_records_drafter_versions(
    tiny, tokenizer, prompt_file, tmp_path
):
    """The shift stream through `vllm serve`: per-window latency, and for an online
    AdaFlash config the drafter version and swaps of every window."""
    logonly = tmp_path / "logonly.json"
    logonly.write_text(
        json.dumps({"adaflash": {"online": {"enabled": True, "spawn_trainer": False}}})
    )
    phases = [load_phase(str(prompt_file), tokenizer, count=4)]
    workload = Workload("shift", phases, window=2, max_tokens=12)
    names = ["plain", f"static@{logonly}"]
    summary = run_benchmark(
        setup=_setup(tiny),
        config_names=names,
        workload=workload,
        out_dir=tmp_path / "out",
        driver="serve",
        command="test",
    )
    _check_outputs(tmp_path / "out", ["plain", "static"], "shift")
    points = json.loads((tmp_path / "out" / "static.json").read_text())["points"]
    assert len(points) == 2 and all(p["itl_ms_p99"] > 0 for p in points)
    assert [p["extra"] for p in points] == [{"drafter_version": 0, "swaps": 0}] * 2
    assert summary["swaps"]["static"]["final_version"] == 0
    assert summary["summary"]["static"]["prompts"]["failed_requests"] == 0
    assert summary["summary"]["static"]["prompts"]["tok_s_vs_static"] == 1.0


def test_unknown_config_and_missing_prompts(tiny, tokenizer, tmp_path):
    with pytest.raises(AdaFlashConfigError, match="unknown benchmark configuration"):
        build_config("eagle9", _setup(tiny))
    with pytest.raises(AdaFlashConfigError, match="prompt file not found"):
        load_phase(str(tmp_path / "missing.jsonl"), tokenizer, count=2)


def test_prompts_too_long_for_the_engine_are_left_out(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    long = " ".join(["word"] * 400)
    path.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["hi", long, "yo", "ok"])
    )
    phase = load_phase(str(path), tokenizer, count=3, max_prompt_tokens=64)
    assert phase.skipped == 1 and len(phase.prompts) == 3
    assert all("word word" not in p for p in phase.prompts)
    with pytest.raises(AdaFlashConfigError, match="no prompt fits"):
        load_phase(str(path), tokenizer, count=3, max_prompt_tokens=1)


def test_server_that_fails_to_start_shows_its_log(tmp_path):
    with pytest.raises(ServerStartError, match="exited with code") as e:
        ServeProcess(
            [str(tmp_path / "no-such-model"), "--max-model-len", "64"],
            startup_timeout_s=120,
        ).start()
    assert "no-such-model" in str(e.value)


def test_interrupted_run_keeps_finished_results(tiny, tokenizer, prompt_file, tmp_path):
    """A configuration that fails midway is reported failed; the others' results and
    the report remain."""
    phases = [load_phase(str(prompt_file), tokenizer, count=2)]
    workload = Workload("shift", phases, window=2, max_tokens=8)
    setup = BenchSetup(
        target=str(tiny.target),
        drafter=str(tmp_path / "missing"),
        num_speculative_tokens=3,
    )
    summary = run_benchmark(
        setup=setup,
        config_names=["plain", "dflash"],
        workload=workload,
        out_dir=tmp_path,
        command="test",
    )
    assert summary["failed"] == ["dflash"]
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["status"] == "ok" and plain["points"]
    assert "failed" in (tmp_path / "report.md").read_text()
