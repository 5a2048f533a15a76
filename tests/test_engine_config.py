"""Bad inputs fail at startup with one clear error (no engine is started)."""

import json
import shutil

import pytest

from adaflash_vllm.errors import AdaFlashConfigError, DrafterMismatchError


def _engine_config(tiny, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny.target),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        speculative_config=spec,
        **kw,
    )
    return args.create_engine_config()


def _drafter_variant(tiny, tmp_path, **changes):
    """A copy of the trained drafter with config.json keys changed."""
    out = tmp_path / "variant"
    shutil.copytree(tiny.drafter_trained, out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_adaflash_section_moves_to_additional_config(tiny):
    """The section reaches every process via additional_config; classes are set."""
    cfg = _engine_config(tiny, tiny.spec(adaflash={"length": {"mode": "debug_ragged"}}))
    assert cfg.additional_config["adaflash"]["length"]["mode"] == "debug_ragged"
    assert cfg.scheduler_config.scheduler_cls.endswith("AdaFlashScheduler")
    assert cfg.parallel_config.worker_extension_cls.endswith("AdaFlashWorkerExtension")
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.observability_config.per_request_spec_decode_metrics == "summary"


def test_without_section_config_is_stock(tiny):
    """No `adaflash` key: nothing of ours is set."""
    cfg = _engine_config(tiny, tiny.spec())
    assert "adaflash" not in (cfg.additional_config or {})
    assert cfg.scheduler_config.scheduler_cls in (
        None,
        "vllm.v1.core.sched.scheduler.Scheduler",
    )
    assert cfg.parallel_config.worker_extension_cls == ""


@pytest.mark.parametrize("given", [None, False, True])
def test_trailing_prefix_cache_block_kept_unless_asked(tiny, given):
    """AdaFlash keeps the prefix-cache block vLLM drops for EAGLE-family drafters
    (its DFlash context K/V there is final); a user's explicit choice stands, and
    stock DFlash keeps vLLM's default."""
    extra = {} if given is None else {"disable_eagle_block_drop": given}
    cfg = _engine_config(tiny, tiny.spec(adaflash={}, **extra))
    assert cfg.speculative_config.use_eagle_block_drop() is (given is False)
    stock = _engine_config(tiny, tiny.spec(**extra))
    assert stock.speculative_config.use_eagle_block_drop() is not bool(given)


def test_config_file_path_is_accepted(tiny):
    path = tiny.write_config("ok.json", tiny.spec(adaflash={}))
    cfg = _engine_config(tiny, str(path))
    assert cfg.speculative_config.method == "dflash"


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"target_layer_ids": [0, 7]}, "within the target's 3 layers"),
        ({"vocab_size": 640}, "vocab_size 640 does not match the target's 512"),
        ({"mask_token_id": 9999}, "mask_token_id 9999 must be a token id in [0, 512)"),
    ],
)
def test_drafter_that_does_not_fit_the_target(tiny, tmp_path, changes, fragment):
    """Drafter/target mismatches are caught at startup with the fix named."""
    spec = tiny.spec(adaflash={})
    spec["model"] = str(_drafter_variant(tiny, tmp_path, **changes))
    with pytest.raises(DrafterMismatchError) as e:
        _engine_config(tiny, spec)
    assert fragment in str(e.value)


def test_hidden_size_mismatch(tiny, tmp_path):
    spec = tiny.spec(adaflash={})
    spec["model"] = str(_drafter_variant(tiny, tmp_path, hidden_size=96))
    with pytest.raises(AdaFlashConfigError, match="hidden_size 96"):
        _engine_config(tiny, spec)


@pytest.mark.parametrize(
    "spec_change, fragment",
    [
        ({"model": "/nonexistent/drafter"}, "drafter not found"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"adaflash": {"lenght": {}}}, "unknown key `adaflash.lenght`"),
    ],
)
def test_bad_speculative_config(tiny, spec_change, fragment):
    spec = {**tiny.spec(adaflash={}), **spec_change}
    with pytest.raises(AdaFlashConfigError) as e:
        _engine_config(tiny, spec)
    assert fragment in str(e.value)


def test_conflicting_scheduler_class(tiny):
    with pytest.raises(AdaFlashConfigError, match="--scheduler-cls .* conflicts"):
        _engine_config(
            tiny,
            tiny.spec(adaflash={}),
            scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
        )


def test_async_scheduling_rejected(tiny):
    with pytest.raises(AdaFlashConfigError, match="synchronous scheduling"):
        _engine_config(tiny, tiny.spec(adaflash={}), async_scheduling=True)


def test_missing_config_file(tiny, tmp_path):
    with pytest.raises(AdaFlashConfigError, match="speculative config file not found"):
        _engine_config(tiny, str(tmp_path / "nope.json"))


def test_required_head_trained_for_another_k(tiny, tiny_head_drafter):
    """A survival head reads K slots: asking for it with another K fails at
    startup, naming both numbers and the fix."""
    spec = tiny.spec(
        k=2, model=str(tiny_head_drafter), adaflash={"length": {"predictor": "head"}}
    )
    with pytest.raises(AdaFlashConfigError, match="trained for K=3.*is 2"):
        _engine_config(tiny, spec)


def test_stats_file_lives_in_memory_and_the_run_folder_on_disk(tiny):
    """The counters' file is renamed into place at every snapshot: in /dev/shm
    (where there is one) that costs ~0.03 ms, on this VM's disk 0.2-4 ms. The
    run folder (a spawned trainer's config and log) stays on disk."""
    import os

    from adaflash_vllm.engine_setup import MEMORY_DIR

    cfg = _engine_config(tiny, tiny.spec(adaflash={}))
    runtime = cfg.additional_config["adaflash_runtime"]
    stats_dir = os.path.dirname(runtime["stats_path"])
    assert os.path.isdir(stats_dir) and os.path.isdir(runtime["run_dir"])
    if os.path.isdir(MEMORY_DIR) and os.access(MEMORY_DIR, os.W_OK):
        assert stats_dir.startswith(MEMORY_DIR + "/")
        assert not runtime["run_dir"].startswith(MEMORY_DIR)


def test_publisher_writes_whole_snapshots_and_survives_a_removed_folder(
    tmp_path, caplog
):
    from adaflash_vllm.metrics import RoundStats, StatsPublisher, read_snapshot

    path = tmp_path / "run" / "stats.json"
    path.parent.mkdir()
    pub, stats = StatsPublisher(str(path), interval_s=60.0), RoundStats(3)
    stats.observe_rounds([3, 0], [2, 0])
    pub.maybe_publish(stats, force=True)
    assert read_snapshot(str(path))["rounds"] == 2
    stats.observe_rounds([3], [3])
    pub.maybe_publish(stats)  # within the interval: nothing written
    assert read_snapshot(str(path))["rounds"] == 2
    shutil.rmtree(path.parent)  # the frontend exited and removed it
    pub.maybe_publish(stats, force=True)  # no exception, no warning
    assert "cannot publish" not in caplog.text
