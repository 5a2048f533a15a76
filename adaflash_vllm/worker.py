"""AdaFlashWorkerExtension: methods vLLM mixes into every worker (via
`worker_extension_cls`), callable with `LLM.collective_rpc` / `POST /collective_rpc`.

Importing this module applies the worker-side patches (see `patches.py`): vLLM
imports it in a worker only when AdaFlash is on, before the model runner exists.
"""

from __future__ import annotations

from typing import Any

from adaflash_vllm import patches

patches.apply_worker_patches()


class AdaFlashWorkerExtension:
    """RPCs on the worker; `self` is vLLM's worker."""

    def adaflash_info(self) -> dict[str, Any]:
        """Which proposer and drafter classes run, and the drafter's version."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        return {
            "proposer": type(drafter).__name__,
            "drafter_model": type(model).__name__,
            "drafter_version": getattr(model, "drafter_version", None),
            "num_speculative_tokens": getattr(drafter, "num_speculative_tokens", None),
            "patches": sorted(patches._APPLIED),
        }

    def adaflash_capture_drafts(self, enable: bool) -> None:
        """Start/stop recording each propose (ids, positions, draft logits)."""
        self.model_runner.drafter.capture_drafts(enable)

    def adaflash_take_captures(self) -> list[dict]:
        drafter = self.model_runner.drafter
        captures = drafter.captures or []
        if drafter.captures is not None:
            drafter.captures = []
        return captures

    def adaflash_timeline(self, enable: bool) -> list[tuple[str, float, float, float]]:
        """The proposer's recorded events (propose starts, swap fetches and
        writes; perf_counter seconds) since the last call; records on if
        `enable`."""
        return self.model_runner.drafter.record_timeline(enable)

    def adaflash_exclude_gap(self, seconds: float) -> None:
        """Benchmarks interleaving engines in one process (examples/
        compare_steps.py): leave the `seconds` this engine sat idle since its
        last step out of the proposer's round and step-cost clocks."""
        drafter = getattr(self.model_runner, "drafter", None)
        if hasattr(drafter, "exclude_gap"):
            drafter.exclude_gap(seconds)

    def adaflash_checksums(self) -> dict[str, str]:
        """Exact checksums of the target's parameters and the drafter's own ones
        (never-touch-the-target checks)."""
        from adaflash_vllm.swap import tensor_checksum

        runner = self.model_runner
        target = runner.get_model()
        drafter = runner.drafter.model
        target_names = {id(p) for p in target.parameters()}
        own = [
            p
            for n, p in sorted(drafter.named_parameters())
            if id(p) not in target_names
        ]
        return {
            "target": tensor_checksum(
                [p for _, p in sorted(target.named_parameters())]
            ),
            "drafter_own": tensor_checksum(own),
            "drafter_fused_kv": tensor_checksum([drafter.model._fused_kv_weight]),
        }

    def adaflash_sampler_stats(self) -> dict[str, list[int]]:
        """The rejection sampler's own counts (per position; verify lengths)."""
        sampler = self.model_runner.rejection_sampler
        return sampler.stats() if hasattr(sampler, "stats") else {}

    def adaflash_budget_state(self) -> dict:
        """The length policy's view: mode, cost curve, last cost-aware choice."""
        drafter = self.model_runner.drafter
        cost = getattr(drafter, "cost_model", None)
        policy = getattr(drafter, "budget_policy", None)
        gate = getattr(drafter, "draft_gate", None)
        block = getattr(drafter, "block_length", None)
        return {
            "policy": type(policy).__name__,
            "cost_model": cost.to_dict() if cost is not None else None,
            "cost_profile_error": getattr(drafter, "cost_profile_error", None),
            "last_choice": getattr(policy, "last_choice", None),
            "calibration": (
                policy.calibration.to_dict() if hasattr(policy, "calibration") else None
            ),
            "has_length_head": getattr(drafter.model, "length_head", None) is not None,
            "length_head_kind": getattr(
                getattr(drafter.model, "length_head", None), "kind", None
            ),
            "length_head_history": bool(
                getattr(getattr(drafter.model, "length_head", None), "history", False)
            ),
            "history_steps": getattr(drafter, "history_steps", 0),
            "survival": type(getattr(policy, "survival", None)).__name__,
            "budget_use": policy.use.to_dict() if hasattr(policy, "use") else None,
            "draft_gate": gate.to_dict() if gate is not None else None,
            "retired": (
                drafter.retired.to_dict()
                if getattr(drafter, "retired", None) is not None
                else None
            ),
            "block_length": block.to_dict() if block is not None else None,
            # the steady skipping state (length.steady_skip): times it started,
            # skipped steps on its short path, those run as plain decoding (W10)
            "steady_skip": {
                "entries": getattr(drafter, "steady_entries", 0),
                "steps": getattr(drafter, "steady_steps", 0),
                "plain_steps": getattr(drafter, "plain_steps", 0),
            },
            "draft_round_trips": patches.draft_round_trips(self.model_runner),
        }

    def adaflash_debug_block_lengths(self) -> None:
        """Debugging and tests: run the drafter on blocks of 1, 2, ..., K draft
        slots on successive drafting steps, whatever the timings (budgets stay
        within each block)."""
        from adaflash_vllm.proposers.block_length import ScriptedBlockLength

        drafter = self.model_runner.drafter
        drafter.block_length = ScriptedBlockLength(drafter.num_speculative_tokens)

    def adaflash_debug_draft_every(self, draft_every: int) -> None:
        """Debugging and tests: run the drafter on every `draft_every`-th step only
        (the others queue their context K/V and verify 0 drafts), whatever the
        timings."""
        from adaflash_vllm.proposers.draft_gate import ScriptedDraftGate

        self.model_runner.drafter.draft_gate = ScriptedDraftGate(draft_every)

    def adaflash_debug_draft_pattern(self, pattern: str) -> None:
        """Debugging and tests: run the drafter on the steps `pattern` marks "d"
        and skip those it marks "s", cycled from the next step ("dds": two of
        three steps draft), whatever the timings."""
        from adaflash_vllm.proposers.draft_gate import ScriptedDraftGate

        self.model_runner.drafter.draft_gate = ScriptedDraftGate(pattern=pattern)

    def adaflash_debug_context_upkeep(self, enable: bool) -> None:
        """Measurements only (examples/compare_steps.py `no_draft:noctx`): with
        False, steps the gate skips no longer queue their context K/V for the
        drafter, which prices that upkeep. The drafter's cache then misses those
        tokens: drafts after it are worse, the output is unchanged (lossless)."""
        self.model_runner.drafter.context_upkeep = bool(enable)

    def adaflash_debug_retire(self, enable: bool, always: bool = False) -> None:
        """Tests and measurements: turn `length.retire_when_skipping` on or off
        (needs a draft gate); with `always`, the engine retires at every batch
        size, whether or not the gate skips decisively (every skipped step
        retires its requests; none drafts again). Off, no request retires any
        more; those retired draft again at their next drafting step, and once
        a step has told the scheduler (its output), prefix hits on the blocks
        they left incomplete are cut there (patches.py E4)."""
        drafter = self.model_runner.drafter
        if getattr(drafter, "draft_gate", None) is None:
            raise ValueError("no draft gate runs (cost_aware with skip_drafting)")
        drafter.retire_when_skipping = bool(enable)
        drafter.retire_always = bool(enable and always)

    def adaflash_debug_prefix_cuts(self, enable: bool) -> None:
        """Tests and measurements: turn `length.cut_holey_prefix_hits` on or
        off; the scheduler follows from the next step's output."""
        self.model_runner.drafter.cut_holey_prefix_hits = bool(enable)

    def adaflash_debug_head_history(self, enable: bool) -> bool:
        """Experiments (examples/compare_no_draft.py `adaflash:nohist`): with
        False, a length head with history reads no previous round (u = 0 for
        every block). Returns whether it reads them now."""
        policy = self.model_runner.drafter.budget_policy
        survival = getattr(policy, "survival", None)
        if policy is None or not getattr(survival, "needs_history", False):
            raise ValueError("no length head with history serves the budgets")
        policy.needs_history = bool(enable)
        return policy.needs_history

    def adaflash_debug_block_cap(self, enable: bool) -> bool:
        """Experiments (examples/compare_no_draft.py `adaflash:nocap`): with
        False, chosen budgets never cap the drafter's block (block_length.py).
        Returns whether they do now."""
        block = getattr(self.model_runner.drafter, "block_length", None)
        if not hasattr(block, "capping"):
            raise ValueError("no adaptive block length in this engine")
        block.capping = bool(enable)
        return block.capping

    def adaflash_debug_steady_plain(self, enable: bool) -> bool:
        """Experiments (examples/compare_no_draft.py `adaflash:noplain`): with
        False, the steady skipping state's steps go through the runner's
        spec-decode path instead of running as plain decoding (patches.py
        W10). Returns whether they run as plain decoding now."""
        drafter = self.model_runner.drafter
        if not hasattr(drafter, "steady_plain"):
            raise ValueError("no AdaFlash proposer in this engine")
        drafter.steady_plain = bool(enable)
        return drafter.steady_plain

    def adaflash_debug_gate(self, settings: dict[str, float]) -> dict[str, Any]:
        """Experiments: set draft-gate parameters (`DraftGate` fields such as
        `switch_z` or `max_interval`) on the running gate; returns its state.
        Unknown fields are refused (nothing is set)."""
        gate = self.model_runner.drafter.draft_gate
        if not hasattr(gate, "configure"):
            raise ValueError("no draft gate runs (cost_aware with skip_drafting)")
        gate.configure(settings)
        return gate.to_dict()
