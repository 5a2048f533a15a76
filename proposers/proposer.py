"""AdaFlashProposer: vLLM's DFlash proposer with per-request draft budgets.

The DFlash forward drafts K tokens per request in one parallel pass (L <= K
with `length.adaptive_block`: block_length.py). A budget
policy then picks k_i <= K per request; `take_budgets()` hands them to the runner's
`take_draft_token_ids` (patched in `patches.py`), which trims each request's drafts
before the scheduler sees them. The scheduler then schedules `1 + k_i` tokens per
request and the target verifies a ragged, packed batch. With `cost_aware` and
`skip_drafting`, a `DraftGate` may decide before the forward that this step drafts
nothing: its context K/V are only queued for the drafter's cache
(`_DeferredContext`) and every budget is 0 (draft_gate.py).

The patch in `patches.py` makes vLLM's model runner build this class wherever it
would build a `DFlashProposer`; without an `adaflash` config section it behaves
exactly like its base class.

Shape symbols: B requests, K drafts per request, H drafter hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import NamedTuple

import numpy as np
import torch
from adaflash_vllm.proposers.block_length import BlockLength, PositionSurvival
from adaflash_vllm.proposers.budget import BudgetPolicy, make_budget_policy
from adaflash_vllm.proposers.cost_model import (
    StepCostModel,
    profile_sizes,
    profile_step_costs,
)
from adaflash_vllm.proposers.draft_gate import BatchSizeGates
from adaflash_vllm.proposers.length_head import (
    CONFIDENCE_FEATURES,
    draft_confidence,
    round_history,
)
from adaflash_vllm.proposers.model import ADAFLASH_ARCH
from adaflash_vllm.proposers.retired_context import RetiredContext
from adaflash_vllm.proposers.row_max import first_argmax
from adaflash_vllm.proposers.steady_skip import MIN_BATCH, SteadySkip
from typing_extensions import override
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from adaflash_vllm.config import config_from_additional

logger = init_logger(__name__)

# DFlash model internals a step without a draft uses (checked at startup).
_CONTEXT_ONLY_NEEDS = ("combine_hidden_states", "precompute_and_store_context_kv")
# Context tokens of skipped steps held before their K/V are written in one pass
# (about 40 MB of target features for Qwen3-8B with 5 aux layers in bf16).
MAX_DEFERRED_TOKENS = 1024


class _DeferredContext:
    """Context K/V of skipped steps, written in one batched pass later.

    A step without a draft must still give the drafter's cache this step's
    context K/V, but nothing reads them until the next drafting step: so they are
    queued (the target's features, positions and cache slots, copied out of the
    runner's reused buffers) and written together, in step order, just before the
    drafter next reads its cache, or once `MAX_DEFERRED_TOKENS` are waiting. Step
    order keeps the cache exactly as writing each step at once would leave it,
    including slots that a finished request freed and a new one reused. One pass
    over many steps' tokens costs far less than one pass per step where the per-op
    overhead dominates (CPU, small batches)."""

    def __init__(self) -> None:
        self.limit = MAX_DEFERRED_TOKENS  # written once this many wait (measurements)
        self._clear()

    def _clear(self) -> None:
        self.states: list[torch.Tensor] = []  # [T_i, aux layers * target hidden]
        self.positions: list[torch.Tensor] = []  # [T_i]
        self.slots: list[torch.Tensor] = []  # [T_i]
        self.tokens = 0
        self.charged_tokens = self.charged_steps = 0

    def add(
        self,
        states: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        charged: bool = True,
    ) -> None:
        """Queue one skipped step's context. `charged`: its cost belongs to
        skipping (false for the tokens a drafting round verified, which the first
        skipped step after it consumes)."""
        # The features are a fresh torch.cat of the aux layers; a view (of the
        # model's output buffer) must be copied like the runner's positions/slots.
        self.states.append(states if states._base is None else states.clone())
        self.positions.append(positions.clone())
        self.slots.append(slots.clone())
        self.tokens += states.shape[0]
        if charged:
            self.charged_tokens += states.shape[0]
            self.charged_steps += 1

    def write(self, model) -> _Written:
        """Write every queued step's K/V (one pass)."""
        steps = len(self.states)
        written = _Written(steps, self.tokens, self.charged_tokens, self.charged_steps)
        if steps == 0:
            return written
        cat = (lambda xs: xs[0]) if steps == 1 else torch.cat
        model.precompute_and_store_context_kv(
            model.combine_hidden_states(cat(self.states)),
            cat(self.positions),
            cat(self.slots),
        )
        self._clear()
        return written


class _Written(NamedTuple):
    """What one write of the deferred context covered."""

    steps: int
    tokens: int
    charged_tokens: int  # of skipped steps that followed a skipped step
    charged_steps: int


class _Propose(NamedTuple):
    """The last propose: when it started and ended, its requests, whether it
    drafted, and whether the propose before it did (None: there was none). The
    step after it times its cost and credits its round from this."""

    started: float
    ended: float
    batch: frozenset[str]
    drafted: bool
    after_drafted: bool | None = None
    budgets: dict[str, int] | None = None  # drafts each request sent to verify
    length: int = 0  # the block it drafted (0: none)
    extended: bool = False  # a full block after a fully accepted round


class _Opened(NamedTuple):
    """A step's propose so far (`_open_step`): when it started, its requests,
    the propose before it, and the gate's verdict."""

    started: float
    req_ids: list[str]
    batch: frozenset[str]
    last: _Propose | None
    draft: bool
    full_accept: bool = False  # every request accepted all the last round's drafts


class AdaFlashProposer(DFlashProposer):
    """DFlash proposer that returns ragged per-request draft budgets."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.adaflash = config_from_additional(vllm_config.additional_config)
        self.budget_policy: BudgetPolicy | None = None  # built in load_model
        self.cost_model: StepCostModel | None = None
        self.cost_profile_error: str | None = None
        self.draft_gate: BatchSizeGates | None = None  # built in load_model
        self.block_length: BlockLength | None = None  # built in load_model
        self._last_propose: _Propose | None = None
        self._opened: _Opened | None = None  # propose_early's, for this step's propose
        self._accepted_total = 0  # the rejection sampler's count at the last step
        self._profiling_target_only = False
        self._runner = runner
        self._mask_hidden: torch.Tensor | None = None  # [B, K, H] of the last propose
        self._choosing = True  # this step chooses budgets (BudgetUse)
        self._confidence_ms = 0.0  # the confidence features' time, this step
        self._mask_confidence: torch.Tensor | None = None  # [B * K, 3], same propose
        self._deferred = _DeferredContext()  # context K/V of skipped steps
        # S_j of verified rounds, for the block length (block_length.py)
        self._position_survival = PositionSurvival(self.num_speculative_tokens)
        # the sampler's rows that drafted / accepted their first draft, as last
        # read (`_credit_first_acceptance`)
        self._first_counts = (0, 0)
        # Measurements only (adaflash_debug_context_upkeep): False queues nothing
        # on skipped steps, so that a benchmark can price the upkeep; the drafter's
        # cache then lacks those tokens (later drafts worse, output unchanged).
        self.context_upkeep = True
        # length.retire_when_skipping (retired_context.py): built at first use,
        # once vLLM has set the drafter's KV cache block size
        self.retire_when_skipping = False
        self.retire_always = False  # debug: retire on every skipped step
        self.retired: RetiredContext | None = None
        self._holes_retiring = False  # `retiring` as last sent (take_holes)
        self.cut_holey_prefix_hits = False  # length.cut_holey_prefix_hits
        self._holes_cut = False  # ... as last sent (take_holes)
        # length.steady_skip: skipped steps on the short path while the gate
        # and retiring are steady (steady_skip.py); the state, while in it
        self.steady_skip = False
        self._steady: SteadySkip | None = None
        self.steady_entries = 0  # times the state started
        self.steady_steps = 0  # skipped steps on its short path
        # ... of which the runner ran as plain decoding steps (patches.py W10;
        # `steady_plain` False: measurements only, every one through the
        # runner's spec-decode path)
        self.steady_plain = True
        self.plain_steps = 0
        self._budgets: dict[str, int] | None = None
        self.history_steps = 0  # choices whose head read the previous round
        self.captures: list[dict] | None = None  # debug: see capture_drafts()
        # debug: (event, start, end, cpu seconds), see record_timeline()
        self.timeline: list[tuple[str, float, float, float]] | None = None

    @override
    def _get_model(self):
        if self.adaflash is None:
            return super()._get_model()
        # Build our subclass for any z-lab checkpoint ("DFlashDraftModel"): swap the
        # architecture name only while vLLM resolves the class.
        hf_config = self.draft_model_config.hf_config
        saved = hf_config.architectures
        hf_config.architectures = [ADAFLASH_ARCH]
        try:
            return super()._get_model()
        finally:
            hf_config.architectures = saved

    @override
    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.swapper = None
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if self.adaflash is not None:
            self.budget_policy = make_budget_policy(
                self.adaflash.length,
                head=self._usable_length_head(),
                cost=lambda: self.cost_model,
            )
            self.draft_gate = self._make_draft_gate(
                get_tensor_model_parallel_world_size()
            )
            length = self.adaflash.length
            self.retire_when_skipping = (
                length.retire_when_skipping and self.draft_gate is not None
            )
            self.cut_holey_prefix_hits = length.cut_holey_prefix_hits
            self.steady_skip = length.steady_skip
            if length.mode == "cost_aware" and length.adaptive_block:
                self.block_length = BlockLength(
                    full=self.num_speculative_tokens, k_min=length.k_min
                )
        if self.adaflash is None or not self.adaflash.online.enabled:
            return

        from adaflash_vllm.swap import DrafterSwapper

        online = self.adaflash.online
        self.swapper = DrafterSwapper(
            self.model,
            staging=online.swap_staging,
            push_timeout_s=online.push_timeout_s,
            backend="nccl" if self.device.type == "cuda" else "gloo",
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
        )
        # A restarted engine resumes from the newest good version: the scheduler
        # orders that swap for the first step (one source of truth for the version).

    def _usable_length_head(self) -> torch.nn.Module | None:
        """The drafter's length head, unless it was trained for another K (a
        survival head reads K slots' features; startup checks refuse this when
        the head is required)."""
        head = getattr(self.model, "length_head", None)
        trained_k = getattr(head, "num_drafts", None)
        if trained_k is not None and trained_k != self.num_speculative_tokens:
            logger.warning(
                "AdaFlash: the drafter's length head was trained for K=%d drafts "
                "but num_speculative_tokens is %d; budgets use the drafter's "
                "confidence instead",
                trained_k,
                self.num_speculative_tokens,
            )
            return None
        return head

    def _make_draft_gate(self, tp_size: int) -> BatchSizeGates | None:
        length = self.adaflash.length
        if length.mode != "cost_aware" or not length.skip_drafting:
            return None
        if tp_size > 1:
            # The skip decision comes from this rank's timings, and skipping changes
            # which collectives the drafter runs: ranks must not decide apart.
            logger.warning(
                "AdaFlash: adaflash.length.skip_drafting is off with tensor "
                "parallelism (%d ranks would time steps apart)",
                tp_size,
            )
            return None
        missing = [n for n in _CONTEXT_ONLY_NEEDS if not hasattr(self.model, n)]
        if missing:
            raise RuntimeError(
                f"AdaFlash skip_drafting needs the DFlash model's {missing}, which "
                f"this vLLM does not have; set adaflash.length.skip_drafting to false"
            )
        return BatchSizeGates()

    def apply_swap(self, order) -> dict:
        """Swap in the drafter version the scheduler ordered (between steps)."""
        self._deferred.write(self.model)  # with the weights live at those steps
        if getattr(self, "swapper", None) is None:
            return {
                "ok": False,
                "version": order.version,
                "stall_s": 0.0,
                "error": "online distillation is off in this worker",
            }
        return self.swapper.apply_order(order)

    @override
    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # vLLM's plain greedy path, with a first-index argmax that a CPU runs
        # ~3x faster over long rows (row_max.py); the same tokens, ties included.
        if self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            return super()._greedy_sample(hidden_states)
        return first_argmax(self.model.compute_logits(hidden_states))

    @override
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # hidden_states: [B * K, H], the drafter's outputs at the K mask positions.
        if self.budget_policy is not None or self.captures is not None:
            self._mask_hidden = hidden_states
        self._confidence_ms = 0.0
        if (
            self.budget_policy is None
            or not self.budget_policy.needs_confidence
            or not self._choosing
        ):
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        # Confidence features of the logits the drafts are sampled from.
        model = self.model
        model.record_confidence, model.last_confidence = True, None
        try:
            drafts = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        finally:
            model.record_confidence = False
        confidence, model.last_confidence = model.last_confidence, None
        if confidence is None or confidence.shape[0] != hidden_states.shape[0]:
            # A sampling path that never built full logits (e.g. a local argmax
            # reduction): compute them once more.
            confidence = draft_confidence(model.compute_logits(hidden_states))
        self._mask_confidence = confidence
        self._confidence_ms = model.confidence_ms
        return drafts

    def _open_step(self, num_reqs: int, num_tokens: int) -> _Opened:
        """What every propose starts with: time the step that just ran (from the
        last propose), credit its round to the gate, and take the gate's verdict
        for this step. `num_tokens`: the tokens the target just processed."""
        started = time.perf_counter()
        if self.timeline is not None:
            self.timeline.append(("propose", started, started, 0.0))
        self._budgets = None
        req_ids = list(self._runner.input_batch.req_ids[:num_reqs])
        batch = frozenset(req_ids)
        last, self._last_propose = self._last_propose, None
        accepted = self._observe_step_cost(last, batch, started, num_tokens)
        full_accept = False
        gate, draft = self.draft_gate, True
        # the sampler's counts, for the block length and the gate's measure of
        # the text (after a drafting step only)
        counts = (
            self._sampler_counts(last)
            if self.block_length is not None or gate is not None
            else None
        )
        if self.block_length is not None:
            self._record_block_round(last, batch, started, counts)
            # every request verified the whole block and accepted all of it (a
            # budget trimmed to one accepted draft says little of the text)
            verified = sum(last.budgets.values()) if last and last.budgets else 0
            full_accept = (
                last is not None
                and last.drafted
                and batch == last.batch
                and verified == len(last.batch) * last.length > 0
                and accepted >= verified
            )
        if gate is not None:
            self._credit_round(gate, last, batch, started, accepted, num_tokens)
            if counts is not None:
                self._credit_first_acceptance(gate, counts)
            cost = self.cost_model
            draft = gate.should_draft(
                num_reqs,
                plain_ms=cost(num_reqs) if cost is not None else None,
                # a round with retired requests (budget 0) measures neither mode
                can_check=not _retired_in(self, batch),
            )
            if getattr(gate, "switched", False):
                _log_switch(gate, num_reqs)
            draft = self._settle_retired(batch, draft)
        return _Opened(started, req_ids, batch, last, draft, full_accept)

    def _settle_retired(self, batch: frozenset[str], draft: bool) -> bool:
        """Whether a step whose gate said `draft` drafts, where its batch holds
        requests retired from drafting (retired_context.py). They draft again
        (`RetiredContext.unretire`, holes and all) where the engine no longer
        retires and the step drafts (the load fell), or where a check of
        drafting waits for a batch without them (`DraftGate.check_waiting`: it
        then runs at the next step, on every request). Where the engine still
        retires, a batch of retired requests only does not draft."""
        if not _retired_in(self, batch):
            return draft
        retired = self.retired
        current = getattr(self.draft_gate, "current", None)  # (scripted: none)
        waiting = current is not None and current.check_waiting
        if waiting or (draft and not self._retiring_now()):
            retired.unretire(batch)
        elif draft and retired.retired >= batch:
            return False  # nobody would verify a draft
        return draft

    def propose_early(
        self,
        *,
        num_tokens: int,
        num_speculative_tokens: int,
        common_attn_metadata,
        context: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> list[list[int]] | None:
        """The runner calls this before it builds the drafter's inputs (patches.py
        W8). When the gate skips this step, skip it here: those inputs (next-token
        ids, rejected-token metadata) are then never built, and `context()` gives
        only what the skipped step needs, (positions [T], target features [T,
        ...]). Returns the step's placeholders (an empty draft per request), or
        None after keeping the step's opening for the `propose` that follows (the
        gate said draft, or there is no gate). In the steady skipping state
        (steady_skip.py) a skipped step takes the short path instead of the
        opening."""
        self._opened = None
        num_reqs = common_attn_metadata.batch_size()
        steady = self._steady
        if steady is not None:
            if self._steady_holds(num_reqs):
                req_ids = self._skip_steadily(
                    steady,
                    num_reqs,
                    num_tokens,
                    lambda: common_attn_metadata.slot_mapping[:num_tokens],
                )
                self._budgets = dict.fromkeys(req_ids, 0)
                return [[] for _ in req_ids]
            self._leave_steady()
        if self.draft_gate is None or self._runner is None or self.captures is not None:
            return None
        opened = self._open_step(num_reqs, num_tokens)
        if opened.draft:
            self._opened = opened
            return None
        every_row_retired = self._every_row_retired(opened.req_ids)
        if every_row_retired:  # no context is read
            positions = features = None
        else:
            positions, features = context()
        self._skip_drafting(
            opened,
            num_speculative_tokens=num_speculative_tokens,
            target_positions=positions,
            target_hidden_states=features,
            common_attn_metadata=common_attn_metadata,
            num_context=num_tokens,
            every_row_retired=every_row_retired,
        )
        if every_row_retired and self._steady_from_here(len(opened.req_ids)):
            self._steady = SteadySkip.enter(
                self.draft_gate,
                req_ids=opened.req_ids,
                started=opened.started,
                ended=self._last_propose.ended,
            )
            self.steady_entries += self._steady is not None
        # The runner's own placeholder form: nothing is copied back or read
        # (every budget is 0: `take_draft_token_ids` returns None, W2).
        return [[] for _ in opened.req_ids]

    def _steady_from_here(self, num_reqs: int) -> bool:
        """Whether the steady skipping state may start after this skipped step
        of `num_reqs` requests (`length.steady_skip`, `MIN_BATCH`, the engine
        retiring; not while a timeline is recorded: the short path records no
        events). `SteadySkip.enter` checks the gate."""
        return (
            self.steady_skip
            and num_reqs >= MIN_BATCH
            and self.timeline is None
            and self._retiring_now()
        )

    def _steady_holds(self, num_reqs: int) -> bool:
        """Whether a step of `num_reqs` requests takes the steady state's short
        path (not while drafts are captured or a timeline is recorded)."""
        steady = self._steady
        return (
            steady is not None
            and self.captures is None
            and self.timeline is None
            and self.retire_when_skipping
            and steady.holds(num_reqs)
        )

    def plain_step(self, scheduler_output) -> bool:
        """Before the runner's step (patches.py W10): whether it is a skipped
        step of the steady state (`_steady_holds` for its batch), which the
        runner may then run as plain decoding. The drafter reads nothing of
        such a step but its requests and their cache slots (`end_plain_step`):
        every row is retired, none verifies a draft."""
        return (
            self.steady_plain
            and scheduler_output.total_num_scheduled_tokens > 0
            and self._steady_holds(len(scheduler_output.num_scheduled_tokens))
        )

    def end_plain_step(
        self, num_reqs: int, num_tokens: int, slots: Callable[[], torch.Tensor]
    ) -> None:
        """After a step `plain_step` let the runner run as plain decoding: its
        short path (`_skip_steadily`), where `propose_early` would have run it,
        and its rounds counted as rounds without a draft (the rejection
        sampler's verify lengths). `slots()`: the drafter's cache slots of the
        step's `num_tokens` tokens. No budgets: the step's output carries no
        drafts (patches.py W5)."""
        self._opened = None
        self.plain_steps += 1
        self._skip_steadily(self._steady, num_reqs, num_tokens, slots)
        self._budgets = None
        self._runner.rejection_sampler.record_bonus_only(num_reqs)

    def _skip_steadily(
        self,
        steady: SteadySkip,
        num_reqs: int,
        num_tokens: int,
        slots: Callable[[], torch.Tensor],
    ) -> list[str]:
        """A skipped step in the steady skipping state (steady_skip.py): counted
        on the gate, its context tokens (cache `slots()`, [num_tokens]) retired
        (as `_retire_rows` retires every row). A decode step of the last step's
        batch whose tokens all land in blocks marked already
        (`SteadySkip.quiet`) reads no slot: at block size 128 most steps. Returns
        the step's request ids."""
        started = time.perf_counter()
        req_ids = self._runner.input_batch.req_ids[:num_reqs]
        same = req_ids == steady.req_ids
        if not same:  # a request finished or arrived (or the order changed)
            batch, last = frozenset(req_ids), self._steady_last(steady)
            same = batch == last.batch
            if not same:  # its round credited as a full step credits it
                self._credit_round(steady, last, batch, started, 0, num_tokens)
        steady.skip(req_ids, num_tokens, started, same)
        self.steady_steps += 1
        retired = self.retired
        decode = num_tokens == num_reqs  # one token per request
        if same and decode and steady.quiet > 0:  # (every request retired)
            steady.quiet -= 1
            retired.dropped_tokens += num_tokens
        else:
            marked = slots().tolist()
            if same:  # every request retired already: only the holes
                retired.dropped_tokens += num_tokens
                retired.mark(marked)
            else:
                self._retire_every_row(req_ids, marked)
            steady.quiet = retired.steps_in_marked_blocks(marked) if decode else 0
        steady.end_step(self._synced_clock())
        return req_ids

    def _leave_steady(self) -> None:
        """End the steady skipping state: fold what its steps measured into the
        gate and the cost curve, and keep its last step as the last propose (the
        next full step credits that step's round and times its cost)."""
        steady, self._steady = self._steady, None
        if steady is None:
            return
        steady.fold(self.cost_model)
        self._last_propose = self._steady_last(steady)

    @staticmethod
    def _steady_last(steady: SteadySkip) -> _Propose:
        """The steady state's last step, as `_remember_propose` keeps a full
        skipped step (after a skipped one)."""
        return _Propose(
            steady.started,
            steady.ended,
            frozenset(steady.req_ids),
            False,
            False,
            dict.fromkeys(steady.req_ids, 0),
        )

    @override
    def propose(self, *args, **kwargs) -> torch.Tensor:
        self._leave_steady()  # (propose_early has, unless it did not run)
        opened, self._opened = self._opened, None  # from propose_early, this step
        cad = kwargs.get("common_attn_metadata")  # vLLM passes keywords only
        if opened is None and (
            self._runner is None
            or cad is None
            or (self.budget_policy is None and self.captures is None)
        ):
            self._budgets = None
            return super().propose(*args, **kwargs)
        num_reqs = cad.batch_size()
        if opened is None:
            opened = self._open_step(num_reqs, kwargs["target_token_ids"].shape[0])
            if not opened.draft:
                self._skip_drafting(opened, **kwargs)
                return torch.zeros(
                    num_reqs,
                    kwargs["num_speculative_tokens"],
                    dtype=torch.int64,
                    device=self.device,
                )
        started, req_ids, batch, last = (
            opened.started,
            opened.req_ids,
            opened.batch,
            opened.last,
        )
        gate = self.draft_gate
        retiring = _retired_in(self, batch)  # some request here verifies no draft
        started = self._write_deferred_context(gate, started)
        full = kwargs["num_speculative_tokens"]  # K (what the scheduler asked for)
        block = self.block_length
        if block is not None and block.full != full:
            block = None
        use = getattr(self.budget_policy, "use", None)
        self._choosing = use is None or use.active(num_reqs)
        if not self._choosing:
            self.budget_policy.skip_choice()
        length = (
            block.next_length(num_reqs, after_full_accept=opened.full_accept)
            if block is not None
            else full
        )
        if length != full:
            kwargs["num_speculative_tokens"] = length  # a shorter block: L <= K masks
        try:
            draft_token_ids = super().propose(*args, **kwargs)  # [B, L]
        finally:
            self.num_speculative_tokens = full
        num_drafts = draft_token_ids.shape[1]
        hidden, confidence = self._mask_hidden, self._mask_confidence
        self._mask_hidden = self._mask_confidence = None
        if hidden is not None and num_drafts > 0:
            hidden = hidden.view(num_reqs, num_drafts, -1)
        if confidence is not None and num_drafts > 0:
            confidence = confidence.view(num_reqs, num_drafts, CONFIDENCE_FEATURES)
        if self.captures is not None and hidden is not None:
            self._capture(req_ids, draft_token_ids, hidden, kwargs)
        if self.budget_policy is not None and not self._choosing:
            # Choosing does not pay at this batch size (BudgetUse): every draft
            # of the block is verified (a short block's padding still is not).
            self._budgets = dict.fromkeys(req_ids, num_drafts)
            self._remember_propose(
                started,
                self._synced_clock(),
                batch,
                True,
                last,
                num_drafts,
                opened.full_accept,
            )
        elif self.budget_policy is not None:
            history = (
                self._round_history(req_ids, last)
                if self.budget_policy.needs_history
                else None
            )
            self.history_steps += history is not None
            chose_at = self._synced_clock()
            budgets = self.budget_policy.choose(
                req_ids=req_ids,
                num_drafts=num_drafts,
                hidden_states=hidden,
                confidence=confidence,
                draft_ms=1e3 * (chose_at - started),
                history=history,
            )
            if budgets is not None:
                self._budgets = dict(zip(req_ids, budgets, strict=True))
                self._cap_block(block, num_reqs, budgets, num_drafts)
            now = self._synced_clock()
            if use is not None and self.budget_policy.last_choice is not None:
                use.record(
                    num_reqs,
                    self.budget_policy.last_choice,
                    1e3 * (now - chose_at) + self._confidence_ms,
                )
            if gate is not None and self.cost_model is not None and not retiring:
                choice = self.budget_policy.last_choice
                gate.record_draft(
                    num_reqs=num_reqs,
                    expected_tokens=choice["expected_tokens"],
                    verify_ms=choice["verify_ms"],
                    draft_ms=1e3 * (now - started),
                    plain_verify_ms=choice["plain_verify_ms"],
                )
            self._remember_propose(
                started, now, batch, True, last, num_drafts, opened.full_accept
            )
        if self._budgets is not None and retiring:
            for req_id in self.retired.retired.intersection(req_ids):
                self._budgets[req_id] = 0  # its drafter context has holes
        if num_drafts < full:  # the runner takes [B, K]; budgets stay <= L
            draft_token_ids = torch.nn.functional.pad(
                draft_token_ids, (0, full - num_drafts)
            )
        return draft_token_ids

    def _cap_block(
        self,
        block: BlockLength | None,
        num_reqs: int,
        budgets: list[int],
        num_drafts: int,
    ) -> None:
        """Give the block length this step's chosen budgets, from which it caps
        the bucket's next blocks (block_length.py)."""
        policy, cost = self.budget_policy, self.cost_model
        choice = getattr(policy, "last_choice", None)
        survival = getattr(policy, "last_survival", None)
        if block is None or cost is None or choice is None or survival is None:
            return
        n = num_reqs + sum(budgets)
        block.record_budgets(
            num_reqs,
            budgets,
            survival.numpy(),
            length=num_drafts,
            round_ms=choice["verify_ms"] + choice["draft_ms"],
            verify_ms_per_token=(cost(n + num_reqs) - cost(n)) / num_reqs,
            draft_ms=choice["draft_ms"],
            measured=self._position_survival.survival(),
        )

    def _skip_drafting(
        self,
        opened: _Opened,
        *,
        num_speculative_tokens: int,
        target_positions: torch.Tensor | None,  # [T]
        target_hidden_states: torch.Tensor | None,  # [T, aux layers * hidden]
        common_attn_metadata,  # of the drafter's KV cache group
        num_context: int | None = None,  # T, where the tensors are None
        every_row_retired: bool | None = None,  # None: `_every_row_retired` here
        **_unused,
    ) -> None:
        """A step without a draft (see draft_gate.py): queue this step's context
        K/V for the drafter's cache (written before the next drafting step reads
        it: `_DeferredContext`), skip the block forward, and verify 0 drafts per
        request (the caller returns placeholders: every budget is 0, so none
        reaches the scheduler).

        The T context tokens are every token the target just processed (rejected
        drafts included, as `set_inputs_first_pass` takes them); their cache slots
        are the drafter group's slot mapping for this step. The query block's
        inputs that it also builds are not needed. Where no row keeps its
        upkeep (`_every_row_retired`), the caller passes no positions or
        features (they are never read), only `num_context`, and says so
        (`every_row_retired`, so that it is not decided twice)."""
        req_ids, last = opened.req_ids, opened.last
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        states = target_hidden_states  # [T, ...]: one row per context token
        if states is not None:
            num_context = states.shape[0]
            positions = target_positions[:num_context]
        slots = common_attn_metadata.slot_mapping[:num_context]
        if self.retire_when_skipping:
            if every_row_retired is None:
                every_row_retired = self._every_row_retired(req_ids)
            kept = self._retire_rows(
                req_ids, common_attn_metadata, slots, every_row_retired
            )
            if kept is not None and kept.numel() == 0:  # every row retired
                states = None
            elif kept is not None:  # some rows retired: upkeep for the rest only
                states, positions, slots = states[kept], positions[kept], slots[kept]
        if self.context_upkeep and states is not None and states.shape[0] > 0:
            self._deferred.add(
                states,
                positions,
                slots,
                # Tokens a drafting round verified are that round's cost.
                charged=last is None or not last.drafted,
            )
        if self._deferred.tokens >= self._deferred.limit:
            self._deferred.write(self.model)  # this skipped step pays for it
        self._budgets = dict.fromkeys(req_ids, 0)
        now = self._synced_clock()
        self.draft_gate.record_skip(1e3 * (now - opened.started))
        self._remember_propose(opened.started, now, opened.batch, False, last)

    def _retire_rows(
        self, req_ids: list[str], cad, slots: torch.Tensor, every_row_retired: bool
    ) -> torch.Tensor | None:
        """`length.retire_when_skipping` on a skipped step: which context tokens
        still get the drafter's K/V (`every_row_retired`: none, as
        `_every_row_retired` says). Where the engine retires (`_retiring_now`),
        every request of the step retires (its upkeep stops, it drafts no more
        until its batch size's gate drafts: `_open_step`),
        in its prompt or in decode; requests already retired get none anywhere
        (a step of retired requests only drops every row at once, as a retiring
        one does).
        Returns the kept token indices, or None to keep every token."""
        retired = self.retired
        if retired is None:
            retired = self.retired = RetiredContext(self.block_size)
        total = slots.shape[0]
        if every_row_retired:  # the steady state under load
            self._retire_every_row(req_ids, slots.tolist())
            return slots.new_empty(0, dtype=torch.long)
        if not retired.retired:
            retired.kept_tokens += total
            return None
        retired.forget_finished(req_ids)
        n = len(req_ids)
        drop = np.fromiter((r in retired.retired for r in req_ids), bool, n)
        counts = np.diff(cad.query_start_loc_cpu[: n + 1].numpy())
        if not drop.any() or counts.sum() != total:  # (else: a layout unknown here)
            retired.kept_tokens += total
            return None
        dropped_tokens = np.repeat(drop, counts)
        index = np.flatnonzero(dropped_tokens)
        retired.kept_tokens += total - len(index)
        retired.dropped_tokens += len(index)
        retired.retire(
            [r for r, d in zip(req_ids, drop, strict=True) if d],
            slots[torch.from_numpy(index).to(slots.device)].tolist(),
        )
        return torch.from_numpy(np.flatnonzero(~dropped_tokens)).to(slots.device)

    def _retire_every_row(self, req_ids: list[str], slots: list[int]) -> None:
        """Every request of a skipped step retires, and its context tokens'
        cache `slots` are holes (`self.retired` exists)."""
        retired = self.retired
        if retired.retired:
            retired.forget_finished(req_ids)
        retired.dropped_tokens += len(slots)
        retired.retire(req_ids, slots)

    def _every_row_retired(self, req_ids: Collection[str]) -> bool:
        """Whether no row of this skipped step keeps its upkeep: the engine
        retires now, or every request of the step is retired already (a check
        of drafting waits for such a batch to clear). Then neither the target's
        features nor positions are gathered for it, nor any row picked."""
        if not self.retire_when_skipping:
            return False
        if self._retiring_now():
            return True
        retired = self.retired
        return retired is not None and retired.retired.issuperset(req_ids)

    def _retiring_now(self) -> bool:
        """Whether the engine retires requests now: at a batch size whose gate
        follows skipping and skips decisively or is held to it by a smaller
        batch's (draft_gate.py), unless a check of drafting waits for the batch
        to clear of retired requests."""
        if not self.retire_when_skipping:
            return False
        if self.retire_always or self._steady is not None:  # (steady: unchanged)
            return True
        current = getattr(self.draft_gate, "current", None)
        return (
            current is not None
            and not current.drafting
            and (current.held or current.skips_decisively(current.retire_margin))
            and not current.check_waiting
        )

    def take_holes(self) -> tuple[bool, int, frozenset, frozenset, bool] | None:
        """For the scheduler's `PrefixHoles` (patches.py W5, E4): (retiring, the
        drafter's KV cache group, block ids that got holes, block ids that lost
        them, whether hits on them are cut: `length.cut_holey_prefix_hits`) when
        any changed since the last step; else None."""
        retired = self.retired
        if retired is None:
            return None
        retiring, cut = self._retiring_now(), self.cut_holey_prefix_hits
        added, removed = retired.take_changes()
        if (
            not added
            and not removed
            and retiring == self._holes_retiring
            and cut == self._holes_cut
        ):
            return None
        self._holes_retiring, self._holes_cut = retiring, cut
        return retiring, max(self.kv_cache_gid, 0), added, removed, cut

    def note_schedule(self, scheduler_output) -> None:
        """Before the step runs (patches.py W4): the blocks vLLM allocated this
        step, for `RetiredContext` (hits on blocks with holes retire a request,
        fresh blocks have none). Nothing to do while no block has holes."""
        retired = self.retired
        if retired is None or not retired.holey:
            return
        gid = max(self.kv_cache_gid, 0)
        for new in scheduler_output.scheduled_new_reqs:
            retired.admit(new.req_id, new.block_ids[gid], new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if blocks is None:
                continue
            if req_id in cached.resumed_req_ids:  # all its blocks, hits included
                retired.admit(req_id, blocks[gid], cached.num_computed_tokens[i])
            else:
                retired.fresh(blocks[gid])

    def _remember_propose(
        self,
        started: float,
        now: float,
        batch: frozenset[str],
        drafted: bool,
        last: _Propose | None,
        length: int = 0,
        extended: bool = False,
    ) -> None:
        """Keep this propose (with the budgets it chose) for the next step."""
        after = None if last is None else last.drafted
        self._last_propose = _Propose(
            started, now, batch, drafted, after, self._budgets, length, extended
        )

    def _write_deferred_context(self, gate, started: float) -> float:
        """Before the drafter reads its cache: write the skipped steps' context
        K/V. That time belongs to skipping, so it is charged to the skipped steps
        and left out of this drafting round; returns the round's new start."""
        if not self._deferred.tokens:
            return started
        before = self._synced_clock()
        written = self._deferred.write(self.model)
        spent = self._synced_clock() - before
        if gate is not None and written.charged_tokens:
            # Per token; the tokens of a drafting round's verification (queued by
            # the first skipped step after it) are left out, as that round is.
            share = written.charged_tokens / max(written.tokens, 1)
            gate.charge_skipped(1e3 * spent * share, written.charged_steps)
        return started + spent

    def _synced_clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _observe_step_cost(
        self,
        last: _Propose | None,
        batch: frozenset[str],
        started: float,
        num_tokens: int,
    ) -> int:
        """Refresh the cost curve from the step that just ran (from the end of the
        last propose to the start of this one: scheduling, the target's forward
        of `num_tokens` tokens and verification) when it ran the same requests as
        the last one. Not after a request finished: served, that step also pays
        the API server's turnover (the finished response, the next request's
        arrival) on the same core, 40% of a skipped step at 16 requests, and the
        curve's point at B - 1 tokens took it as a cost of tokens that its
        running max then spread over every larger count, erasing the slope
        (BENCHMARKS.md run 33). The acceptance calibration learns from the same
        steps (the drafts verified were exactly those predicted). Returns the
        drafts the step accepted."""
        if self.cost_model is None and self.draft_gate is None:
            return 0
        before, self._accepted_total = self._accepted_total, self._sampler_accepted()
        accepted = self._accepted_total - before  # drafts the last step verified
        # Only steps that ran the requests of the last one: a new request brings
        # a prompt chunk, a finished one the turnover above, and a step with
        # nothing in common may follow idle time (every request had finished).
        # Token counts past the table would all land on its last point.
        if (
            self.cost_model is None
            or last is None
            or not batch
            or batch != last.batch
            or num_tokens > self.cost_model.sizes[-1]
        ):
            return accepted
        self.cost_model.observe(num_tokens, 1e3 * (started - last.ended))
        if (
            last.drafted
            and hasattr(self.budget_policy, "observe_accepted")
            and not _retired_in(self, batch)
        ):
            self.budget_policy.observe_accepted(accepted)
        return accepted

    def _credit_round(
        self,
        gate,
        last: _Propose | None,
        batch: frozenset[str],
        started: float,
        accepted: int,
        num_tokens: int,
    ) -> None:
        """Credit the previous step's round (its propose, then the verification of
        what it proposed) to the gate: tokens emitted and ms, start to start.

        Not when this step shares no request with it (the engine may have sat
        idle), nor for the first round after a switch of mode (its propose wrote
        the context K/V of the tokens the other mode's round verified, so it
        measures neither mode). When the verification step also ran new requests'
        prompts, their forward is taken out with the cost curve (cost of the
        step's `num_tokens` minus that of the continuing requests' 1 + k_i), so
        that a prompt is not charged to whichever mode the round was in (under
        load one doubles a step); without a curve such rounds are left out."""
        if last is None or last.batch.isdisjoint(batch):
            return
        if last.after_drafted not in (None, last.drafted):
            return
        if last.drafted and _retired_in(self, last.batch):
            return  # its retired requests verified no draft: not a drafting round
        ms = 1e3 * (started - last.started)
        if not batch <= last.batch:
            cost, budgets = self.cost_model, last.budgets
            if cost is None or budgets is None:
                return
            kept = batch & last.batch
            decode = len(kept) + sum(budgets.get(r, 0) for r in kept)
            ms -= max(cost(num_tokens) - cost(decode), 0.0)
            if ms <= 0:
                return
        gate.record_round(
            drafted=last.drafted, tokens=len(last.batch) + accepted, ms=ms
        )

    def _sampler_counts(self, last: _Propose | None) -> dict[str, list[int]] | None:
        """The rejection sampler's cumulative per-position counts (`stats()`)
        after the last step's verification, when that step drafted (None
        otherwise, or without AdaFlash's sampler)."""
        if last is None or not last.drafted:
            return None
        sampler = getattr(self._runner, "rejection_sampler", None)
        return sampler.stats() if hasattr(sampler, "stats") else None

    def _credit_first_acceptance(self, gate, counts: dict[str, list[int]]) -> None:
        """The last drafting round's rows that verified a draft, and how many
        accepted their first, for the gate's measure of the text (draft_gate.py
        `BatchSizeGates.record_first_acceptance`)."""
        drafted = counts["drafted"][0] if counts["drafted"] else 0
        accepted = counts["accepted"][0] if counts["accepted"] else 0
        before, self._first_counts = self._first_counts, (drafted, accepted)
        gate.record_first_acceptance(drafted - before[0], accepted - before[1])

    def _record_block_round(
        self,
        last: _Propose | None,
        batch: frozenset[str],
        started: float,
        counts: dict[str, list[int]] | None,
    ) -> None:
        """The last step's drafting round, for the block length: its time (its
        propose to this one) when clean (the same requests, none new, and a
        drafting step before it), and the per-position acceptance so far
        (`counts`: `_sampler_counts`)."""
        if last is None or not last.drafted:
            return
        if counts is not None:
            # a full block after a fully accepted round is not weighed in the S_j
            survival = self._position_survival
            take = survival.skip if last.extended else survival.update
            take(counts["drafted"], counts["accepted"])
        if (
            batch == last.batch
            and last.after_drafted is not False
            and not _retired_in(self, batch)
        ):
            self.block_length.record_round(
                length=last.length,
                num_reqs=len(last.batch),
                round_ms=1e3 * (started - last.started),
                survival=self._position_survival.survival,  # read if deciding
            )

    def _round_history(
        self, req_ids: list[str], last: _Propose | None
    ) -> torch.Tensor | None:
        """Each request's previous round for a length head with history
        (`length_head.round_history`), [B, 3] on the device without a host sync:
        the drafts it verified (the last propose's budgets) and the tokens it
        emitted in this step's verification, whose rows are this step's batch
        order, as `req_ids` is. None (no previous round for any request) when no
        verification ran this step or the last propose did not draft."""
        sampler = getattr(self._runner, "rejection_sampler", None)
        take = getattr(sampler, "take_emitted", None)
        emitted = take() if take is not None else None
        if (
            emitted is None
            or emitted.shape[0] != len(req_ids)
            or last is None
            or not last.drafted
            or not last.budgets
        ):
            return None
        verified = torch.tensor(
            [last.budgets.get(r, 0) for r in req_ids], dtype=torch.long
        ).to(emitted.device, non_blocking=True)
        return round_history(emitted - 1, verified, self.num_speculative_tokens)

    def _sampler_accepted(self) -> int:
        sampler = getattr(self._runner, "rejection_sampler", None)
        return sampler.accepted_total() if hasattr(sampler, "accepted_total") else 0

    @override
    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        if self._profiling_target_only:  # the cost profile times verification only
            return
        super().dummy_run(num_tokens, *args, **kwargs)

    def ensure_cost_profile(self, runner) -> None:
        """Profile step cost vs verified tokens once, before the first real step
        (timed dummy forwards); on failure fall back to the paper rule, loudly."""
        if (
            self.cost_model is not None
            or self.cost_profile_error is not None
            or self.adaflash is None
            or self.adaflash.length.mode != "cost_aware"
        ):
            return
        if not self.adaflash.length.profile:
            self.cost_profile_error = "profiling disabled (adaflash.length.profile)"
            return
        k = self.num_speculative_tokens
        max_tokens = min(
            runner.max_num_tokens, runner.scheduler_config.max_num_seqs * (1 + k)
        )
        sampler = getattr(runner, "rejection_sampler", None)
        if hasattr(sampler, "recording"):
            sampler.recording = False  # dummy batches are not served rounds
        self._profiling_target_only = True
        try:
            sync = torch.cuda.synchronize if self.device.type == "cuda" else None
            self.cost_model = profile_step_costs(
                lambda n: runner._dummy_run(n),
                profile_sizes(max_tokens, every_up_to=2 * (1 + k)),
                sync=sync,
            )
            logger.info(
                "AdaFlash cost profile (verified tokens -> ms): %s",
                dict(
                    zip(
                        self.cost_model.sizes,
                        (round(t, 2) for t in self.cost_model.times_ms),
                        strict=True,
                    )
                ),
            )
        except Exception as e:  # noqa: BLE001  (a failed profile must not stop serving)
            self.cost_profile_error = f"{type(e).__name__}: {e}"
            logger.warning(
                "AdaFlash: cost profile failed (%s); cost_aware falls back to "
                "the paper rule",
                self.cost_profile_error,
            )
        finally:
            self._profiling_target_only = False
            if hasattr(sampler, "recording"):
                sampler.recording = True

    def _capture(self, req_ids, draft_token_ids, hidden, inputs: dict) -> None:
        """Record what the drafter saw and produced (parity tests, debugging)."""
        b, k = draft_token_ids.shape
        query = slice(0, b * (k + 1), k + 1)  # the bonus slot of each request
        logits = self.model.compute_logits(hidden.reshape(b * k, -1))
        self.captures.append(
            {
                "req_ids": req_ids,
                "bonus_positions": self.positions[query].cpu().tolist(),
                "bonus_token_ids": self.input_ids[query].cpu().tolist(),
                "draft_token_ids": draft_token_ids.cpu().tolist(),
                "logits": logits.view(b, k, -1).float().cpu().tolist(),
                # What the target fed the drafter this step (its aux hidden states,
                # concatenated, for every token the target processed).
                "context_positions": inputs["target_positions"].cpu().tolist(),
                "context_token_ids": inputs["target_token_ids"].cpu().tolist(),
                "context_features": inputs["target_hidden_states"]
                .float()
                .cpu()
                .tolist(),
                "context_starts": inputs["common_attn_metadata"]
                .query_start_loc_cpu[: b + 1]
                .tolist(),
            }
        )

    def record_timeline(self, enable: bool) -> list[tuple[str, float, float, float]]:
        """Debugging and benchmarks: return the events recorded so far, as
        (kind, perf_counter start, end, CPU seconds of its thread): each
        propose's start, swap fetches in the background and writes between steps;
        then start afresh, or stop."""
        events, self.timeline = self.timeline or [], [] if enable else None
        swapper = getattr(self, "swapper", None)
        if swapper is not None:
            swapper.timeline = self.timeline
        return events

    def capture_drafts(self, enable: bool) -> None:
        """Start (fresh) or stop recording every propose() into `self.captures`."""
        self.captures = [] if enable else None

    def exclude_gap(self, seconds: float) -> None:
        """Benchmarks that interleave several engines' steps in one process: this
        engine sat idle for `seconds` since its last step ended (others ran).
        Shift the last propose's clock by that much (the steady skipping
        state's last step too, while in it), so that the round it opened and
        the step cost measured from its end leave the idle time out."""
        steady = self._steady
        if steady is not None and seconds > 0:
            steady.started += seconds
            steady.ended += seconds
        last = self._last_propose
        if last is not None and seconds > 0:
            self._last_propose = last._replace(
                started=last.started + seconds, ended=last.ended + seconds
            )

    def take_budgets(self) -> dict[str, int] | None:
        """Budgets chosen at the last propose (each handed out once)."""
        budgets, self._budgets = self._budgets, None
        return budgets


def _retired_in(proposer, batch: frozenset[str] | list[str]) -> bool:
    """Whether any request of `batch` is retired from drafting (retired_context)."""
    retired = getattr(proposer, "retired", None)
    return (
        retired is not None
        and bool(retired.retired)
        and not retired.retired.isdisjoint(batch)
    )


def _log_switch(gate: BatchSizeGates, num_reqs: int) -> None:
    d, s = gate.draft_rate.ratio(), gate.skip_rate.ratio()
    logger.info(
        "AdaFlash draft gate: %s at %d requests (drafting rounds %s, skipped %s "
        "tokens/ms); next check in %d steps",
        "drafting again" if gate.drafting else "skipping the drafter",
        num_reqs,
        "?" if d is None else f"{d:.3f}",
        "?" if s is None else f"{s:.3f}",
        gate.interval,
    )
