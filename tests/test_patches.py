"""Every vLLM monkeypatch lives in patches.py, is guarded, and can be reverted."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaflash_vllm import patches
from adaflash_vllm.errors import PatchGuardError

ROOT = Path(__file__).resolve().parents[1]


def test_engine_patches_applied_by_plugin():
    """Loading vLLM's plugins applies E1-E4 and wraps the right functions."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert all(patches.is_applied(p) for p in ("E1", "E2", "E3", "E4"))
    assert EngineArgs.create_engine_config.__name__ == "create_engine_config"
    assert "accepting_paths" in EngineArgs.add_cli_args.__name__


def test_worker_patches_swap_proposer_and_revert():
    """W1/W2 replace the runner's DFlashProposer and trim hook (W4-W9 are
    applied too; W3 only where the CPU overrides are); revert restores."""
    import vllm.v1.worker.gpu_model_runner as gmr
    from adaflash_vllm.proposers.proposer import AdaFlashProposer
    from vllm.v1.spec_decode.dflash import DFlashProposer

    original_take = gmr.GPUModelRunner.take_draft_token_ids
    patches.apply_worker_patches()
    try:
        assert gmr.DFlashProposer is AdaFlashProposer
        assert issubclass(AdaFlashProposer, DFlashProposer)
        assert gmr.GPUModelRunner.take_draft_token_ids is not original_take
        assert all(patches.is_applied(f"W{i}") for i in (1, 2, 4, 5, 6, 7, 8, 9))
    finally:
        patches.revert_all()
    assert gmr.DFlashProposer is DFlashProposer
    assert gmr.GPUModelRunner.take_draft_token_ids is original_take
    patches.apply_engine_patches()  # leave the engine patches as the plugin set them


def test_post_step_skips_the_draft_round_trip_only_for_drafts_that_came_along():
    """E3: the engine core's extra `take_draft_token_ids` is skipped only for a
    step whose drafts the AdaFlash scheduler took from the output."""
    calls = []
    post_step = patches._wrap_post_step(lambda core, executed: calls.append(executed))

    class Scheduler:
        took = False

        def took_drafts_from_output(self):
            took, self.took = self.took, False
            return took

    core = SimpleNamespace(scheduler=Scheduler())
    post_step(core, True)
    assert calls == [True]
    core.scheduler.took = True
    post_step(core, True)  # drafts came with the output: no round trip
    post_step(core, False)  # the next step's did not
    assert calls == [True, False]
    core.scheduler = object()  # vLLM's own scheduler
    post_step(core, True)
    assert calls == [True, False, True]


def test_drafts_taken_for_the_output_are_handed_out_again():
    """W2: a `take_draft_token_ids` after W5 took them returns the same drafts
    (not the untrimmed ones), once."""
    fresh = SimpleNamespace(req_ids=["a"], draft_token_ids=[[1, 2, 3]])
    take = patches._wrap_take_draft_token_ids(lambda runner: fresh)
    runner = SimpleNamespace()
    runner._adaflash_drafts = held = SimpleNamespace(
        req_ids=["a"], draft_token_ids=[[1]]
    )
    assert take(runner) is held
    assert take(runner) is fresh  # nothing held any more: the runner's own


def test_step_with_no_budget_never_reads_the_drafts_back():
    """W2: when every budget is 0 (a gated step) the drafts are not read back;
    with some budget they are trimmed per request; other drafters untouched."""
    calls = []

    def orig(runner):
        calls.append(1)
        return SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[1, 2, 3]] * 2)

    take = patches._wrap_take_draft_token_ids(orig)
    runner = SimpleNamespace(drafter=SimpleNamespace(take_budgets=lambda: {"a": 0}))
    assert take(runner) is None and calls == []
    runner.drafter.take_budgets = lambda: {"a": 0, "b": 2}
    assert take(runner).draft_token_ids == [[], [1, 2]] and calls == [1]
    other = SimpleNamespace(drafter=object())
    assert take(other).draft_token_ids == [[1, 2, 3]] * 2


def test_metadata_of_a_step_without_drafts_is_only_its_logits_indices():
    """W9: no drafts (AdaFlash's drafter) -> one logit per request at its last
    scheduled token, as plain decoding; drafts or another drafter -> vLLM's."""
    import numpy as np
    import torch

    calls = []
    gmr = SimpleNamespace(
        async_tensor_h2d=lambda a, device: torch.as_tensor(a, device=device)
    )
    calc = patches._wrap_calc_spec_decode_metadata(
        lambda *a: calls.append(a) or "vllm's", gmr
    )
    runner = SimpleNamespace(drafter=SimpleNamespace(take_budgets=dict), device="cpu")
    cu = np.array([1, 2, 5, 6])  # the third request is prefilling 3 tokens
    spec = calc(runner, np.zeros(4, dtype=np.int32), cu)
    assert spec.logits_indices.tolist() == [0, 1, 4, 5] and calls == []
    assert spec.num_draft_tokens == [0, 0, 0, 0] and spec.max_spec_len == 0
    assert calc(runner, np.array([0, 2, 0, 0]), cu) == "vllm's"
    other = SimpleNamespace(drafter=object(), device="cpu")
    assert calc(other, np.zeros(4, dtype=np.int32), cu) == "vllm's"
    assert len(calls) == 2


class _Sampler:
    def __init__(self):
        self.bonus_only = []

    def record_bonus_only(self, n):
        self.bonus_only.append(n)


def test_step_without_drafts_samples_as_plain_decoding():
    """W7: spec-decode metadata in which no request verifies a draft becomes
    None (plain sampling; the rounds still counted); with drafts it stays."""

    def metadata(num_drafts):
        return SimpleNamespace(
            max_spec_len=max(num_drafts), num_draft_tokens=list(num_drafts)
        )

    # (a scheduler output that gave drafts: W7 cannot tell them from here)
    step = SimpleNamespace(scheduled_spec_decode_tokens={"r": [5, 6]})
    runner = SimpleNamespace(
        drafter=SimpleNamespace(take_budgets=dict), speculative_config="spec"
    )
    runner.rejection_sampler = _Sampler()
    for num_drafts, kept in (([0, 0, 0], False), ([0, 2, 0], True)):
        spec = metadata(num_drafts)
        prepare = patches._wrap_prepare_inputs(lambda *a, spec=spec: ("idx", spec, 1))
        assert prepare(runner, step, None) == ("idx", spec if kept else None, 1)
    assert runner.rejection_sampler.bonus_only == [3]
    # Another proposer (not AdaFlash's): vLLM's path is left alone.
    spec = metadata([0, 0])
    prepare = patches._wrap_prepare_inputs(lambda *a: ("idx", spec, 1))
    other = SimpleNamespace(
        drafter=object(), rejection_sampler=_Sampler(), speculative_config="spec"
    )
    assert (
        prepare(other, SimpleNamespace(scheduled_spec_decode_tokens={}), None)[1]
        is spec
    )


def _kv_cache_config(*specs):
    groups = [SimpleNamespace(kv_cache_spec=s) for s in specs]
    return SimpleNamespace(kv_cache_groups=groups)


def test_step_given_no_draft_prepares_as_plain_decoding():
    """W7: when the scheduler gave no request a draft, the original runs with
    the speculative config hidden (vLLM's plain path: no spec-decode metadata
    is built at all) and restored after, the rounds counted; not where a KV
    cache group keeps recurrent state, nor before the KV cache exists, nor for
    another proposer."""
    import numpy as np
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    seen = []

    def orig(runner, scheduler_output, num_scheduled_tokens):
        seen.append(runner.speculative_config)
        spec = metadata if runner.speculative_config is not None else None
        return "idx", spec, 1

    metadata = SimpleNamespace(max_spec_len=0, num_draft_tokens=[0, 0, 0])
    prepare = patches._wrap_prepare_inputs(orig)
    no_drafts = SimpleNamespace(scheduled_spec_decode_tokens={})
    attention = FullAttentionSpec.__new__(FullAttentionSpec)
    runner = SimpleNamespace(
        drafter=SimpleNamespace(take_budgets=dict),
        rejection_sampler=_Sampler(),
        speculative_config="spec",
        kv_cache_config=None,
    )
    # no KV cache yet: vLLM's spec-decode path (W7 then drops the metadata)
    assert prepare(runner, no_drafts, np.ones(3)) == ("idx", None, 1)
    runner.kv_cache_config = _kv_cache_config(attention)
    assert prepare(runner, no_drafts, np.ones(3)) == ("idx", None, 1)
    assert seen == ["spec", None] and runner.speculative_config == "spec"
    assert runner.rejection_sampler.bonus_only == [3, 3]
    # (an entry without drafts is no draft either)
    prepare(runner, SimpleNamespace(scheduled_spec_decode_tokens={"r": []}), [1, 1])
    assert seen[-1] is None and runner.rejection_sampler.bonus_only[-1] == 2
    # the config comes back even when the original raises
    broken = patches._wrap_prepare_inputs(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        broken(runner, no_drafts, np.ones(3))
    assert runner.speculative_config == "spec"
    # recurrent state (GDN, Mamba): vLLM's path, which writes its draft counts
    recurrent = SimpleNamespace(
        drafter=SimpleNamespace(take_budgets=dict),
        rejection_sampler=_Sampler(),
        speculative_config="spec",
        kv_cache_config=_kv_cache_config(attention, MambaSpec.__new__(MambaSpec)),
    )
    seen.clear()
    assert prepare(recurrent, no_drafts, np.ones(3)) == ("idx", None, 1)
    assert seen == ["spec"]
    # another proposer, or none (no speculative decoding): untouched
    other = SimpleNamespace(
        drafter=object(), speculative_config="spec", kv_cache_config=None
    )
    seen.clear()
    assert prepare(other, no_drafts, np.ones(3))[1] is metadata and seen == ["spec"]
    plain = SimpleNamespace(speculative_config=None, kv_cache_config=None)
    assert prepare(plain, no_drafts, np.ones(3)) == ("idx", None, 1)
    # W10's plain step (the config hidden by W4): the original as it is, the
    # rounds counted by the proposer's `end_plain_step` (W5), not here
    runner.speculative_config, counted = None, len(runner.rejection_sampler.bonus_only)
    seen.clear()
    assert prepare(runner, no_drafts, np.ones(3)) == ("idx", None, 1)
    assert seen == [None] and len(runner.rejection_sampler.bonus_only) == counted


def test_prepare_inputs_guard_reads_the_speculative_config_once():
    """W7's startup check: vLLM's `_prepare_inputs` reads the speculative config
    only to choose its path; a version that reads it elsewhere fails loudly."""
    import vllm.v1.worker.gpu_model_runner as gmr

    patches._check_reads_speculative_config_once(gmr.GPUModelRunner._prepare_inputs)

    def reads_twice(self, scheduler_output, num_scheduled_tokens):
        use_spec_decode = self.speculative_config is not None
        return use_spec_decode, self.speculative_config.method

    with pytest.raises(PatchGuardError, match="_prepare_inputs"):
        patches._check_reads_speculative_config_once(reads_twice)


class _SteadyDrafter:
    """A proposer whose steady skipping state holds for `plain` steps (W10)."""

    kv_cache_gid = 0

    def __init__(self, plain: bool):
        self.plain, self.ended = plain, []

    def plain_step(self, scheduler_output):
        return self.plain

    def end_plain_step(self, num_reqs, num_tokens, slots):
        self.ended.append((num_reqs, num_tokens, slots().tolist()))


def _plain_step_runner(drafter, kv_cache_config=None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    slot_mapping = SimpleNamespace(gpu=torch.tensor([40, 41, 77, 5, -1, -1]))
    return SimpleNamespace(
        drafter=drafter,
        speculative_config="spec",
        valid_sampled_token_count_event=None,
        kv_cache_config=kv_cache_config
        or _kv_cache_config(FullAttentionSpec.__new__(FullAttentionSpec)),
        execute_model_state=None,
        input_batch=SimpleNamespace(
            block_table=[SimpleNamespace(slot_mapping=slot_mapping)]
        ),
    )


def test_steady_skipped_step_runs_as_plain_decoding():
    """W10: a step the proposer's steady state holds for runs from
    `execute_model` through `sample_tokens` with the speculative config hidden
    (vLLM's plain decoding step), restored after; then the proposer gets the
    step's requests and the drafter's cache slots of its tokens. Not for a
    step the state does not hold for, with recurrent state or async
    scheduling, nor for a step that verifies drafts; the config comes back
    when either half raises or when no `sample_tokens` follows."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    seen = []

    def execute(runner, scheduler_output, intermediate_tensors=None):
        seen.append(("execute", runner.speculative_config))
        runner.execute_model_state = "state"
        return None

    def sample(runner, grammar_output):
        seen.append(("sample", runner.speculative_config))
        runner.execute_model_state = None
        return None  # (no output: W5's own additions are left out)

    execute_model = patches._wrap_execute_model(execute)
    sample_tokens = patches._wrap_sample_tokens(sample)
    step = SimpleNamespace(
        total_num_scheduled_tokens=4,
        num_scheduled_tokens={"a": 1, "b": 3},
        scheduled_spec_decode_tokens={"a": []},
    )

    def run(runner):
        seen.clear()
        execute_model(runner, step)
        sample_tokens(runner, None)
        return list(seen)

    drafter = _SteadyDrafter(plain=True)
    runner = _plain_step_runner(drafter)
    assert run(runner) == [("execute", None), ("sample", None)]
    assert runner.speculative_config == "spec"
    assert drafter.ended == [(2, 4, [40, 41, 77, 5])]
    drafter.plain = False  # the state does not hold: the spec-decode step
    assert run(runner) == [("execute", "spec"), ("sample", "spec")]
    assert len(drafter.ended) == 1
    # recurrent state (as W7), async scheduling: never plain
    drafter.plain = True
    mamba = _kv_cache_config(
        FullAttentionSpec.__new__(FullAttentionSpec), MambaSpec.__new__(MambaSpec)
    )
    assert run(_plain_step_runner(drafter, mamba))[0] == ("execute", "spec")
    async_runner = _plain_step_runner(drafter)
    async_runner.valid_sampled_token_count_event = object()
    assert run(async_runner)[0] == ("execute", "spec")
    assert len(drafter.ended) == 1
    # a step that verifies drafts is never run as plain decoding
    step.scheduled_spec_decode_tokens = {"a": [5, 6]}
    assert run(runner)[0] == ("execute", "spec")
    step.scheduled_spec_decode_tokens = {}
    assert len(drafter.ended) == 1
    # the config comes back when either half raises (and the step is not counted)
    broken = patches._wrap_execute_model(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        broken(runner, step)
    assert runner.speculative_config == "spec"
    execute_model(runner, step)
    with pytest.raises(ZeroDivisionError):
        patches._wrap_sample_tokens(lambda *a: 1 / 0)(runner, None)
    assert runner.speculative_config == "spec" and len(drafter.ended) == 1
    # an execute_model that returns its output itself: no sample_tokens follows
    direct = patches._wrap_execute_model(lambda *a: "output")
    assert direct(runner, step) == "output"
    assert runner.speculative_config == "spec"
    assert "_adaflash_plain" not in runner.__dict__


def test_plain_steps_output_carries_no_drafts_without_taking_them():
    """W5 on a W10 step with output: the output says "no drafts" (the engine
    core then skips its own take: E3) without running `take_draft_token_ids`
    (the proposer chose no budgets for it) and without counting a take, so
    `draft_round_trips` stays exact; the gate's counters still ride along. A
    step that is not plain still takes its drafts."""
    drafter = _SteadyDrafter(plain=True)
    drafter.draft_gate = SimpleNamespace(drafted_steps=0, skipped_steps=5)
    drafter.take_holes = lambda: None
    drafter.take_budgets = dict
    runner = _plain_step_runner(drafter)
    runner.vllm_config = SimpleNamespace(max_concurrent_batches=1)
    taken = []

    def take():
        taken.append(1)
        runner._adaflash_draft_takes = getattr(runner, "_adaflash_draft_takes", 0) + 1
        return "drafts"

    runner.take_draft_token_ids = take
    step = SimpleNamespace(
        total_num_scheduled_tokens=2,
        num_scheduled_tokens={"a": 1, "b": 1},
        scheduled_spec_decode_tokens={},
    )
    execute_model = patches._wrap_execute_model(lambda *a: None)

    def sample(runner, grammar_output):
        return SimpleNamespace()

    sample_tokens = patches._wrap_sample_tokens(sample)
    runner.execute_model_state = "state"
    execute_model(runner, step)
    output = sample_tokens(runner, None)
    assert output.adaflash_drafts == (None,) and taken == []
    assert runner._adaflash_drafts is None and drafter.ended == [(2, 2, [40, 41])]
    assert output.adaflash_gate["draft_gate_skipped_steps"] == 5
    assert patches.draft_round_trips(runner) == 0
    drafter.plain = False  # a full step: its drafts are taken and sent
    execute_model(runner, step)
    output = sample_tokens(runner, None)
    assert output.adaflash_drafts == ("drafts",) and taken == [1]
    assert patches.draft_round_trips(runner) == 0


def test_plain_step_guard_knows_every_read_of_the_speculative_config():
    """W10's startup check: every runner method that reads the speculative
    config in a step reads it only in lines known to leave a step without
    drafts as plain decoding; a version with another read fails loudly."""
    import vllm.v1.worker.gpu_model_runner as gmr

    patches._check_step_reads_of_speculative_config(gmr.GPUModelRunner)

    class Newer(gmr.GPUModelRunner):
        def _bookkeeping_sync(self, *args):
            if self.speculative_config is not None and self.num_spec_tokens:
                return None

    with pytest.raises(PatchGuardError, match="_bookkeeping_sync"):
        patches._check_step_reads_of_speculative_config(Newer)


def test_skipped_step_never_builds_the_drafters_inputs():
    """W8: when `propose_early` skips the step, the original (which builds the
    drafter's inputs) is not called and the context is the step's T tokens;
    otherwise the original runs and the kept opening is cleared after it."""
    import torch

    calls, seen = [], {}

    class Drafter:
        skip = True
        _opened = None

        def propose_early(self, **kw):
            seen.update(kw)
            if self.skip:
                return "placeholders"
            self._opened = "opened"
            return None

    runner = SimpleNamespace(
        drafter=Drafter(),
        valid_sampled_token_count_event=None,
        speculative_config=SimpleNamespace(disable_padded_drafter_batch=False),
        _get_positions=lambda n: torch.arange(n),
        _draft_probs="stale",
        _draft_prob_req_ids="stale",
    )
    wrapped = patches._wrap_propose_draft_token_ids(
        lambda *a: calls.append(a[0].drafter._opened) or "drafts"
    )
    out = SimpleNamespace(total_num_scheduled_tokens=3, num_spec_tokens_to_schedule=7)
    aux = [torch.ones(5, 2), 2 * torch.ones(5, 2)]
    args = (out, None, None, None, None, aux, None, "cad", None)
    assert wrapped(runner, *args) == "placeholders"
    assert calls == [] and runner._draft_probs is None
    positions, features = seen["context"]()
    assert positions.tolist() == [0, 1, 2] and features.shape == (3, 4)
    assert seen["num_speculative_tokens"] == 7 and seen["common_attn_metadata"] == "cad"
    runner.drafter.skip = False
    assert wrapped(runner, *args) == "drafts"
    assert calls == ["opened"] and runner.drafter._opened is None
    runner.valid_sampled_token_count_event = object()  # async scheduling
    runner.drafter.skip = True
    assert wrapped(runner, *args) == "drafts"
    # The same arguments partly by keyword: read by name, passed on as given.
    runner.valid_sampled_token_count_event = None
    seen.clear()
    keywords = {"aux_hidden_states": aux, "common_attn_metadata": "cad2"}
    assert wrapped(runner, *args[:5], **keywords) == "placeholders"
    assert seen["common_attn_metadata"] == "cad2"
    assert seen["context"]()[1].shape == (3, 4)


def test_guard_trips_on_changed_signature():
    """A recorded signature that no longer matches fails loudly, naming the target."""

    class Fake:
        def take_draft_token_ids(self, extra):
            return None

    with pytest.raises(PatchGuardError, match="take_draft_token_ids.*differs"):
        patches._check_signature(Fake, "take_draft_token_ids", ("self",))
    with pytest.raises(PatchGuardError, match="does not exist"):
        patches._check_signature(Fake, "missing", ("self",))


def test_guard_trips_on_unsupported_vllm(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(PatchGuardError, match="found vLLM 0.40.1"):
        patches._check_version()


def test_only_patches_module_assigns_vllm_attributes():
    """No module but patches.py monkeypatches vLLM (assignments to vllm objects)."""
    offenders = []
    pattern = re.compile(
        r"^\s*(vllm|gmr|EngineArgs|GPUModelRunner|Scheduler)\.[\w.]+\s*=[^=]"
    )
    for folder in ("adaflash_vllm", "proposers", "training", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "patches.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) or re.search(r"setattr\((vllm|gmr)\b", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_cpu_expand_fix_writes_float_outputs():
    """W3: vLLM's CPU expand override drops float outputs (temperatures); ours
    expands them like the Triton kernel."""
    import torch
    from vllm.utils import cpu_triton_utils as cpu_tl

    temps = torch.tensor([0.7, -1.0, 1.3])  # -1 stands for greedy
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    want = torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])
    ours = torch.full((6,), float("nan"))
    patches.expand_kernel_torch(ours, temps, cu, -1.0, 1.0)
    assert torch.equal(ours, want)
    theirs = torch.full((6,), float("nan"))
    cpu_tl._expand_kernel_impl(theirs, temps, cu, -1, 1)
    assert not torch.equal(theirs, want)  # the upstream bug W3 exists to fix
    ints = torch.zeros(6, dtype=torch.int64)
    patches.expand_kernel_torch(ints, torch.tensor([5, 0, 7]), cu, 0, 9)
    assert ints.tolist() == [5, 5, 9, 7, 7, 7]
