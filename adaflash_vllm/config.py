"""The `adaflash` section of adaflash.json: typed structs, loading and validation.

adaflash.json is one speculative config: vLLM's own keys (`method`, `model`,
`num_speculative_tokens`, ...) plus an `"adaflash"` section. The plugin strips the
section before vLLM sees the rest, decodes it into `AdaFlashConfig` (unknown keys
fail with the list of valid ones) and carries it to the engine core and every
worker in `VllmConfig.additional_config["adaflash"]`.

Every key here is documented in docs/CONFIG.md; tests/test_config.py keeps the two in
sync.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from adaflash_vllm.errors import AdaFlashConfigError

ADAFLASH_KEY = "adaflash"
"""Name of the section in adaflash.json and of the `additional_config` entry."""
RUNTIME_KEY = "adaflash_runtime"
"""`additional_config` entry with values the plugin derives (not user keys)."""
MAX_SPEC_TOKENS = 32
"""Upper bound on num_speculative_tokens we accept (vLLM's sampler allows 128)."""


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config struct: immutable, keyword-only, no unknown keys."""


class LengthConfig(_Struct):
    """How many of the K drafted tokens each request sends to verification."""

    mode: Literal["fixed", "debug_ragged", "paper", "cost_aware"] = "fixed"
    # fixed: every request verifies all K drafts (stock DFlash behaviour).
    # debug_ragged: k_i drawn deterministically from hash(req_id, round) in [0, K];
    #   exercises ragged verification (including k_i = 0) end to end.
    # paper: k_i = clamp(round(a_hat * K * gamma), k_min, K) (the AdaFlash rule).
    # cost_aware: the k_i maximising expected tokens per second of measured step time.
    gamma: Annotated[float, Meta(gt=0, le=4)] = 1.0
    # paper: scale on the predicted accepted length.
    k_min: Annotated[int, Meta(ge=0, le=MAX_SPEC_TOKENS)] = 1
    # paper / cost_aware: every request verifies at least this many drafts.
    predictor: Literal["auto", "head", "confidence"] = "auto"
    # Acceptance estimate: the drafter's length head, or its own draft confidence
    # (auto: the head when the checkpoint has one).
    profile: bool = True
    # cost_aware: time dummy steps at startup (else start from the paper rule and
    # learn the cost curve from served steps only).
    skip_drafting: bool = True
    # cost_aware: skip the drafter's forward on steps where even the best budgets
    # would emit fewer tokens per second than plain decoding (probing again later).
    adaptive_block: bool = True
    # cost_aware: run the drafter on a block of only the L <= K slots that pay
    # for their time, per batch-size bucket, from measured round times and
    # per-position acceptance (block_length.py).
    retire_when_skipping: bool = True
    # cost_aware with skip_drafting: where the gate skips decisively, a skipped
    # step's requests (prompts included) stop keeping the drafter's context K/V
    # (its per-token upkeep) and verify no draft until their batch size's gate
    # drafts again (proposers/retired_context.py). On by default since run 34:
    # 1.028 +- 0.008 of it off at 64 requests, no change at 4 and 16.
    cut_holey_prefix_hits: bool = False
    # with retire_when_skipping, once the engine no longer retires: a
    # prefix-cache hit on blocks whose drafter K/V retired requests left
    # incomplete is cut before them, and the request recomputes them (a whole
    # drafter context). False keeps the hit, as plain vLLM does; the request
    # drafts over the holes. Follow-up turns at 2 requests after a burst of 64:
    # keeping ran 1.05 +- 0.07x as fast as cutting (BENCHMARKS.md run 35).
    steady_skip: bool = True
    # with retire_when_skipping, from 8 requests on: while the engine retires,
    # the gate follows skipping and its next check of drafting is not due, a
    # skipped step only counts itself and marks its holes; the gate's rates and
    # the cost curve learn from such steps once, when the state ends
    # (steady_skip.py).


class AdmissionConfig(_Struct):
    """EMA admission control of waiting requests (AdaFlash scheduler)."""

    enabled: bool = True
    beta: Annotated[float, Meta(gt=0, le=1)] = 0.3
    # N_hat <- (1 - beta) * N_hat + beta * N after each step (N = requests processed).
    token_budget: Annotated[int, Meta(ge=1)] | None = None
    # Verified tokens per step, sum(1 + k_i) (None = vLLM's max_num_batched_tokens).


class MetricsConfig(_Struct):
    """AdaFlash counters on vLLM's /metrics (and LLM.get_metrics())."""

    publish_interval_s: Annotated[float, Meta(ge=0.0, le=60.0)] = 1.0
    # The engine core publishes its counters at most this often (0 = every step).


class OnlineConfig(_Struct):
    """Online on-policy distillation: log what is served, train, hot-swap."""

    enabled: bool = False
    # Log finished requests and swap in versions the trainer publishes.
    buffer_dir: str = "adaflash-online/buffer"
    # Trajectory segments (relative paths: against the working directory).
    versions_dir: str = "adaflash-online/versions"
    # Published drafter versions (also where a restarted engine resumes from).
    buffer_max_mb: Annotated[float, Meta(gt=0)] = 512.0
    # Cap on the buffer's disk use; the oldest segments are deleted beyond it.
    segment_mb: Annotated[float, Meta(gt=0)] = 16.0
    queue_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 4096
    # Finished requests waiting for the writer thread; more are dropped, counted.
    log_requests: bool = True
    # Default for requests that do not say (`extra_args: {"adaflash_log": false}`).
    train_every: Annotated[int, Meta(ge=1)] = 128
    # New trajectories per training round.
    epochs: Annotated[int, Meta(ge=1, le=100)] = 2
    batch_size: Annotated[int, Meta(ge=1, le=1024)] = 2
    # Sequences per optimizer step (the effective batch).
    lr: Annotated[float, Meta(gt=0, le=1.0)] = 3e-4
    alpha: Annotated[float, Meta(ge=0, le=1)] = 0.8
    # Loss mix: alpha * CE(target top-1) + (1 - alpha) * clipped reverse KL.
    delta: Annotated[float, Meta(gt=0)] = 0.01
    # Entry-wise clip of the reverse-KL terms (sign rule: training/losses.py).
    gamma: Annotated[float, Meta(gt=0)] = 4.0
    # Position decay w_k = exp(-(k-1)/gamma) over the K draft slots.
    num_anchors: Annotated[int, Meta(ge=0, le=4096)] = 32
    # Random anchors per sequence besides the logged round positions.
    replay: Annotated[float, Meta(ge=0, le=4)] = 0.0
    # Earlier trajectories trained on per round besides the new ones, as a share
    # of them, drawn from a uniform sample of all trained on so far
    # (training/replay.py): against forgetting what the traffic no longer sends.
    replay_pool: Annotated[int, Meta(ge=1, le=1_000_000)] = 1024
    # Trajectories that sample keeps.
    max_len: Annotated[int, Meta(ge=16)] = 2048
    grad_clip: Annotated[float, Meta(gt=0)] = 1.0
    spawn_trainer: bool = False
    # Start `adaflash trainer` from the engine (else run it yourself).
    trainer_cores: list[Annotated[int, Meta(ge=0)]] | None = None
    # CPU cores for the trainer process (None = no pinning).
    trainer_device: Literal["auto", "cpu", "cuda"] = "auto"
    trainer_ranks: Annotated[int, Meta(ge=1, le=64)] = 1
    # Data-parallel trainer processes (DDP; gloo on CPU, NCCL on GPU, one GPU each).
    push: bool = True
    # Push new versions over torch.distributed (else workers read the folder).
    push_host: str = "127.0.0.1"
    push_port: Annotated[int, Meta(ge=1024, le=65535)] = 29650
    push_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 10.0
    swap_staging: Literal["thread", "slices", "one_step"] = "slices"
    # Where a received version is checked and staged (re-packs, copies): in ~2 ms
    # slices between steps, in the fetch thread beside the steps, or all in the
    # step that writes it.
    poll_interval_s: Annotated[float, Meta(ge=0, le=600)] = 1.0
    # How often the engine looks for a new version (between steps).
    gate_window: Annotated[int, Meta(ge=0)] = 256
    # Rounds of live tau compared between a new version and the previous one
    # (0 = no regression gate).
    gate_margin: Annotated[float, Meta(ge=0, le=1)] = 0.05
    # Roll back when the new version's tau is worse by more than this fraction.


class AdaFlashConfig(_Struct):
    """The whole `"adaflash"` section; `{}` turns AdaFlash on with defaults."""

    length: LengthConfig = msgspec.field(default_factory=LengthConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    online: OnlineConfig = msgspec.field(default_factory=OnlineConfig)
    per_request_metrics: Literal["none", "summary", "detailed"] = "summary"
    # Sets vLLM's --per-request-spec-decode-metrics unless given explicitly.


class RuntimeInfo(_Struct):
    """Values the plugin derives at startup and ships next to the user's section."""

    num_speculative_tokens: int
    stats_path: str  # file the engine core publishes AdaFlash counters to
    run_dir: str = ""  # this engine's folder (a spawned trainer's config, log)
    target: str = ""  # the served model (the online trainer loads its own copy)
    drafter: str = ""  # the drafter the engine started from (version 0)


def iter_config_keys(cls: type = AdaFlashConfig, prefix: str = ADAFLASH_KEY):
    """Yield the dotted path of every leaf key, e.g. `adaflash.length.mode`."""
    for field in msgspec.structs.fields(cls):
        path = f"{prefix}.{field.name}"
        if _struct_type(field.type) is not None:
            yield from iter_config_keys(_struct_type(field.type), path)
        else:
            yield path


def _struct_type(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None


def _check_keys(data: Any, cls: type, path: str) -> None:
    """Reject unknown keys with the list of valid ones (msgspec names only one)."""
    if not isinstance(data, dict):
        raise AdaFlashConfigError(
            f"`{path}` must be a JSON object, got {type(data).__name__}: {data!r}"
        )
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise AdaFlashConfigError(
                f"unknown key `{path}.{key}`.{hint} "
                f"Valid keys in `{path}`: {', '.join(sorted(fields))}."
            )
        sub = _struct_type(fields[key].type)
        if sub is not None:
            _check_keys(value, sub, f"{path}.{key}")


def parse_adaflash_section(section: Any) -> AdaFlashConfig:
    """Decode and validate the `"adaflash"` section.

    Raises:
        AdaFlashConfigError: unknown key (with the valid ones) or a bad value
            (with its JSON path and the constraint it broke).

    Example:
        >>> parse_adaflash_section({"length": {"mode": "fixed"}}).length.mode
        'fixed'
    """
    _check_keys(section, AdaFlashConfig, ADAFLASH_KEY)
    try:
        return msgspec.convert(section, AdaFlashConfig)
    except msgspec.ValidationError as e:
        msg = str(e).replace("`$", f"`{ADAFLASH_KEY}")
        raise AdaFlashConfigError(f"invalid adaflash config: {msg}") from None


def read_speculative_config(value: str | dict | None) -> dict | None:
    """Turn what a user passed as the speculative config into a dict.

    Accepts a dict, an inline JSON object, or a path to a JSON file. A relative
    drafter `model` path in a file is resolved against the file's folder when it
    exists there, so `examples/adaflash.json` works from any working directory.
    """
    if value is None or isinstance(value, dict):
        return None if value is None else dict(value)
    if not isinstance(value, str):
        raise AdaFlashConfigError(
            f"speculative config must be a dict, JSON text or a path to a JSON "
            f"file, got {type(value).__name__}"
        )
    text = value.strip()
    if text.startswith("{"):
        return _loads(text, "inline --speculative-config JSON")
    path = Path(os.path.expanduser(text))
    if not path.is_file():
        raise AdaFlashConfigError(
            f"speculative config file not found: {text!r} (cwd {os.getcwd()}). "
            "Pass a path to adaflash.json or inline JSON starting with '{'."
        )
    spec = _loads(path.read_text(encoding="utf-8"), str(path))
    if not isinstance(spec, dict):
        raise AdaFlashConfigError(f"{path}: the top level must be a JSON object")
    model = spec.get("model")
    if isinstance(model, str) and not os.path.isabs(model):
        candidate = path.parent / model
        if candidate.exists():
            spec["model"] = str(candidate.resolve())
    return spec


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AdaFlashConfigError(
            f"{where} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


def split_adaflash_section(spec: dict) -> tuple[dict, AdaFlashConfig | None]:
    """Split adaflash.json into (vLLM's speculative dict, our config or None)."""
    spec = dict(spec)
    if ADAFLASH_KEY not in spec:
        return spec, None
    section = spec.pop(ADAFLASH_KEY)
    cfg = parse_adaflash_section({} if section is None else section)
    check_spec_for_adaflash(spec)
    return spec, cfg


def check_spec_for_adaflash(spec: dict) -> None:
    """vLLM keys AdaFlash needs: `method` dflash (defaulted) and K in range."""
    method = spec.setdefault("method", "dflash")
    if method != "dflash":
        raise AdaFlashConfigError(
            f'AdaFlash serves DFlash drafters: set "method": "dflash" (got {method!r})'
            ' or remove the "adaflash" section.'
        )
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
        raise AdaFlashConfigError(
            f"num_speculative_tokens must be an integer in [1, {MAX_SPEC_TOKENS}] "
            f"(got {k!r}); for a block-16 DFlash drafter use 15."
        )


def config_from_additional(additional: dict | None) -> AdaFlashConfig | None:
    """The AdaFlash config carried in `VllmConfig.additional_config`, if any."""
    if not additional or ADAFLASH_KEY not in additional:
        return None
    return msgspec.convert(additional[ADAFLASH_KEY], AdaFlashConfig)


def runtime_from_additional(additional: dict | None) -> RuntimeInfo | None:
    if not additional or RUNTIME_KEY not in additional:
        return None
    return msgspec.convert(additional[RUNTIME_KEY], RuntimeInfo)
