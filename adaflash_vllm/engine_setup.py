"""Frontend-side setup: turn adaflash.json into vLLM engine arguments, then check the
drafter against the target once vLLM has built its config.

Runs in the process that calls `EngineArgs.create_engine_config` (the API server for
`vllm serve`, the user's process for `LLM`), through the patch in `patches.py`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from adaflash_vllm.config import (
    ADAFLASH_KEY,
    RUNTIME_KEY,
    AdaFlashConfig,
    RuntimeInfo,
    check_spec_for_adaflash,
    parse_adaflash_section,
    read_speculative_config,
    split_adaflash_section,
)
from adaflash_vllm.errors import AdaFlashConfigError, DrafterMismatchError

SCHEDULER_CLS = "adaflash_vllm.scheduler.AdaFlashScheduler"
WORKER_EXTENSION_CLS = "adaflash_vllm.worker.AdaFlashWorkerExtension"


def prepare_engine_args(args: Any) -> AdaFlashConfig | None:
    """Rewrite `args` (an `EngineArgs`) in place when its speculative config has an
    `"adaflash"` section; return the decoded section, or None for stock vLLM.

    Moves the section into `additional_config`, sets the AdaFlash scheduler and
    worker extension, and turns off what would silently stop drafting (async
    scheduling, Model Runner V2).
    """
    spec = read_speculative_config(args.speculative_config)
    if spec is None:
        return None
    spec, cfg = split_adaflash_section(spec)
    args.speculative_config = spec
    if cfg is None and ADAFLASH_KEY in (args.additional_config or {}):
        # Given as --additional-config '{"adaflash": {...}}', or a second call.
        cfg = parse_adaflash_section(args.additional_config[ADAFLASH_KEY])
        check_spec_for_adaflash(spec)
        args.speculative_config = spec
    if cfg is None:
        return None
    check_drafter_dir(spec.get("model"))
    check_length_policy(cfg, spec)
    _keep_trailing_cache_block(spec)
    _set_class(args, "scheduler_cls", SCHEDULER_CLS, "--scheduler-cls")
    _set_class(
        args, "worker_extension_cls", WORKER_EXTENSION_CLS, "--worker-extension-cls"
    )
    _require_sync_mrv1(args)
    if getattr(args, "per_request_spec_decode_metrics", "none") == "none":
        args.per_request_spec_decode_metrics = cfg.per_request_metrics
    extra = dict(args.additional_config or {})
    cfg = resolve_online_paths(cfg)
    extra[ADAFLASH_KEY] = msgspec.to_builtins(cfg)
    run_dir = tempfile.mkdtemp(prefix="adaflash-run-")
    extra[RUNTIME_KEY] = msgspec.to_builtins(
        RuntimeInfo(
            num_speculative_tokens=spec["num_speculative_tokens"],
            stats_path=_new_stats_path(run_dir),
            run_dir=run_dir,
            target=_abs_if_local(args.model),
            drafter=_abs_if_local(spec.get("model", "")),
        )
    )
    args.additional_config = extra
    return cfg


KEEP_BLOCK_KEY = "disable_eagle_block_drop"


def _keep_trailing_cache_block(spec: dict) -> None:
    """Default vLLM's `disable_eagle_block_drop` to true (unless given).

    vLLM drops the last matched prefix-cache block for every EAGLE-family drafter,
    DFlash included, because an EAGLE drafter's K/V there may not be final. A
    DFlash drafter's context K/V at a position is written from the target's hidden
    state there, in the step the target computed it (or, for steps without a draft,
    queued and written in order before the drafter next reads its cache), so a
    cached block's drafter K/V is final and the block can be reused like plain
    vLLM does (measured: same hits as plain, same acceptance; BENCHMARKS.md).
    """
    from vllm.config import SpeculativeConfig

    if KEEP_BLOCK_KEY in spec or KEEP_BLOCK_KEY not in getattr(
        SpeculativeConfig, "__dataclass_fields__", {}
    ):
        return  # the user's choice, or a vLLM without the option
    spec[KEEP_BLOCK_KEY] = True


def _set_class(args: Any, attr: str, ours: str, flag: str) -> None:
    current = getattr(args, attr)
    if current in (None, "", ours):
        setattr(args, attr, ours)
        return
    if attr == "scheduler_cls" and _is_adaflash_scheduler(current):
        return
    raise AdaFlashConfigError(
        f"{flag} {current!r} conflicts with AdaFlash, which sets {flag} {ours}. "
        f"Remove {flag}, or subclass {ours} and pass that."
    )


def _is_adaflash_scheduler(cls: Any) -> bool:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from adaflash_vllm.scheduler import AdaFlashScheduler

    if isinstance(cls, str):
        try:
            cls = resolve_obj_by_qualname(cls)
        except Exception:
            return False
    return isinstance(cls, type) and issubclass(cls, AdaFlashScheduler)


def _require_sync_mrv1(args: Any) -> None:
    # Ragged per-request drafts need the synchronous MRv1 path: the async scheduler
    # schedules placeholder drafts and MRv2 ignores a custom proposer.
    if args.async_scheduling:
        raise AdaFlashConfigError(
            "AdaFlash needs synchronous scheduling (ragged per-request drafts); "
            "drop --async-scheduling / async_scheduling=True."
        )
    args.async_scheduling = False
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v2 not in (None, "", "0", "false", "False"):
        raise AdaFlashConfigError(
            f"AdaFlash runs on vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER="
            f"{v2}. Unset it or set VLLM_USE_V2_MODEL_RUNNER=0."
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def resolve_online_paths(cfg: AdaFlashConfig) -> AdaFlashConfig:
    """Make the online folders absolute, so the trainer and a restarted engine agree
    whatever their working directory."""
    online = msgspec.structs.replace(
        cfg.online,
        buffer_dir=os.path.abspath(cfg.online.buffer_dir),
        versions_dir=os.path.abspath(cfg.online.versions_dir),
    )
    return msgspec.structs.replace(cfg, online=online)


def _abs_if_local(path: str) -> str:
    return os.path.abspath(path) if path and os.path.exists(path) else path


MEMORY_DIR = "/dev/shm"


def _new_stats_path(run_dir: str) -> str:
    """Where the engine core publishes its counters for the frontend: a folder in
    memory (/dev/shm) where there is one, removed when this process exits; else
    `run_dir`. A snapshot is written to a temporary file and renamed over the
    last one; on this VM's ext4 such a rename over an existing file took 0.2-4
    ms (the filesystem flushes the new file's data first), 0.03 ms in /dev/shm,
    and the engine publishes when the last request ends, so at one request that
    was up to 5% of the steps' time under the profiler (BENCHMARKS.md run 23)."""
    if os.path.isdir(MEMORY_DIR) and os.access(MEMORY_DIR, os.W_OK):
        try:
            folder = tempfile.mkdtemp(prefix="adaflash-stats-", dir=MEMORY_DIR)
        except OSError:
            pass
        else:
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            return str(Path(folder) / "stats.json")
    return str(Path(run_dir) / "stats.json")


def _looks_like_path(model: str) -> bool:
    """A local path rather than a Hugging Face id (`org/name`: exactly one slash,
    and no such folder here)."""
    return (
        model.startswith((".", "/", "~"))
        or model.count("/") != 1
        or os.path.exists(model)
    )


def check_drafter_dir(model: Any) -> None:
    """Fail early, and clearly, when the drafter folder is missing or unusable."""
    if not isinstance(model, str) or not model:
        raise AdaFlashConfigError(
            'the speculative config needs "model": the DFlash drafter folder '
            "(z-lab format) or its Hugging Face id."
        )
    if not os.path.exists(model):
        if _looks_like_path(model) or os.environ.get("HF_HUB_OFFLINE") == "1":
            raise AdaFlashConfigError(
                f"drafter not found: {model!r} (speculative config key `model`). "
                "Point it at a DFlash drafter folder with config.json and "
                "model.safetensors."
            )
        return  # a Hugging Face id; vLLM downloads it
    cfg_path = Path(model) / "config.json"
    if not cfg_path.is_file():
        raise AdaFlashConfigError(f"drafter folder {model!r} has no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdaFlashConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    dflash = cfg.get("dflash_config") or {}
    if "target_layer_ids" not in dflash and "target_layer_ids" not in cfg:
        raise AdaFlashConfigError(
            f"{cfg_path} is not a DFlash drafter: it lacks "
            "dflash_config.target_layer_ids (and dflash_config.mask_token_id)."
        )
    if not any(
        p.suffix == ".safetensors" or p.name.endswith(".bin")
        for p in Path(model).iterdir()
    ):
        raise AdaFlashConfigError(f"drafter folder {model!r} has no weight files")


def check_length_policy(cfg: AdaFlashConfig, spec: dict) -> None:
    """k_min within K; a required length head present and shaped for the drafter."""
    k = spec["num_speculative_tokens"]
    if cfg.length.k_min > k:
        raise AdaFlashConfigError(
            f"adaflash.length.k_min {cfg.length.k_min} exceeds num_speculative_tokens "
            f"{k}; use 0..{k}."
        )
    model = spec.get("model")
    if not (isinstance(model, str) and os.path.isdir(model)):
        return
    from adaflash_vllm.proposers.length_head import head_config, load_length_head

    drafter_cfg = json.loads((Path(model) / "config.json").read_text())
    try:
        head = load_length_head(model, drafter_cfg)
    except (ValueError, KeyError, OSError) as e:
        raise AdaFlashConfigError(
            f"drafter {model!r}: unusable length head: {e}"
        ) from None
    if (
        cfg.length.predictor == "head"
        and head is not None
        and head.num_drafts not in (None, k)
    ):
        raise AdaFlashConfigError(
            f"drafter {model!r}: its length head was trained for K={head.num_drafts} "
            f"drafts but num_speculative_tokens is {k}; set num_speculative_tokens "
            f'to {head.num_drafts}, or use "predictor": "auto" (the drafter\'s '
            "confidence replaces the head)."
        )
    if cfg.length.predictor == "head" and head is None:
        named = head_config(drafter_cfg)
        raise AdaFlashConfigError(
            f'adaflash.length.predictor is "head" but drafter {model!r} has '
            + (
                "no length_head.safetensors"
                if named
                else "no length head (dflash_config.thresh_head_bottleneck_dim)"
            )
            + "; train one with `adaflash train-drafter --length-head 64` or use "
            '"predictor": "auto".'
        )


def check_drafter_fits_target(vllm_config: Any) -> None:
    """Compare the drafter's config with the target's; raise on any mismatch.

    vLLM itself would only fail at the first forward (or silently draft garbage).
    """
    spec = vllm_config.speculative_config
    target = vllm_config.model_config
    draft_hf = spec.draft_model_config.hf_config
    tgt_layers = target.get_total_num_hidden_layers()
    tgt_vocab = target.get_vocab_size()
    tgt_hidden = target.get_hidden_size()
    dflash = getattr(draft_hf, "dflash_config", None) or {}
    layer_ids = dflash.get(
        "target_layer_ids", getattr(draft_hf, "target_layer_ids", [])
    )
    where = f"drafter {spec.draft_model_config.model!r}"
    bad = [i for i in layer_ids if not 0 <= int(i) < tgt_layers]
    if not layer_ids or bad:
        raise DrafterMismatchError(
            f"{where}: dflash_config.target_layer_ids {list(layer_ids)} must be "
            f"non-empty and within the target's {tgt_layers} layers "
            f"(0..{tgt_layers - 1})."
            " This drafter was trained for a different target."
        )
    draft_hidden = getattr(draft_hf, "hidden_size", None)
    fc_in = getattr(draft_hf, "target_hidden_size", None) or draft_hidden
    if draft_hidden != tgt_hidden or fc_in != tgt_hidden:
        raise DrafterMismatchError(
            f"{where}: hidden_size {draft_hidden} (target_hidden_size {fc_in}) does "
            f"not match the target's hidden_size {tgt_hidden}; the drafter shares "
            "the target's embedding and reads its hidden states."
        )
    draft_vocab = getattr(draft_hf, "vocab_size", None)
    if getattr(draft_hf, "draft_vocab_size", None) in (None, draft_vocab) and (
        draft_vocab != tgt_vocab
    ):
        raise DrafterMismatchError(
            f"{where}: vocab_size {draft_vocab} does not match the target's "
            f"{tgt_vocab}; the drafter uses the target's lm_head."
        )
    mask = dflash.get("mask_token_id", getattr(draft_hf, "mask_token_id", None))
    if mask is None or not 0 <= int(mask) < tgt_vocab:
        raise DrafterMismatchError(
            f"{where}: dflash_config.mask_token_id {mask!r} must be a token id in "
            f"[0, {tgt_vocab}) of the target vocabulary."
        )
    if vllm_config.use_v2_model_runner:
        raise AdaFlashConfigError(
            "vLLM selected Model Runner V2, which AdaFlash does not drive; set "
            "VLLM_USE_V2_MODEL_RUNNER=0."
        )
