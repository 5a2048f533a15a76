"""AdaFlashScheduler: vLLM's scheduler plus per-request, per-round draft bookkeeping.

A *round* is one decode step of one request: the target verified `1 + k` tokens
(the last accepted token plus k drafts) and accepted `a <= k` drafts. For every
request the scheduler keeps its rounds as (position, k, a), where position is the
number of tokens the request had before the round (so the round's first new token
lands at index `position`). Counters go to /metrics through `metrics.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing_extensions import override
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from adaflash_vllm.admission import AdmissionControl
from adaflash_vllm.config import config_from_additional, runtime_from_additional
from adaflash_vllm.metrics import RoundStats, StatsPublisher
from adaflash_vllm.online_engine import OnlineController
from adaflash_vllm.proposers.retired_context import PrefixHoles

logger = init_logger(__name__)


@dataclass
class RequestRounds:
    """The rounds of one request, in order."""

    positions: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)  # k_i verified per round
    num_accepted: list[int] = field(default_factory=list)

    def add(self, position: int, num_drafts: int, num_accepted: int) -> None:
        self.positions.append(position)
        self.num_drafts.append(num_drafts)
        self.num_accepted.append(num_accepted)


class AdaFlashScheduler(Scheduler):
    """Records every verification round; everything else is vLLM's scheduler."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        additional = self.vllm_config.additional_config
        self.adaflash = config_from_additional(additional)
        runtime = runtime_from_additional(additional)
        k = self.vllm_config.speculative_config.num_speculative_tokens
        self.round_stats = RoundStats(k)
        self.rounds: dict[str, RequestRounds] = {}
        self._gate: dict[str, int] = {}  # the worker's draft-gate counters
        self._took_drafts = False  # this step's drafts came with its output
        self._publisher = (
            StatsPublisher(runtime.stats_path, self.adaflash.metrics.publish_interval_s)
            if runtime is not None and self.adaflash is not None
            else None
        )
        self.admission = (
            AdmissionControl(self.adaflash.admission, k)
            if self.adaflash is not None and self.adaflash.admission.enabled
            else None
        )
        self.online = (
            OnlineController(self.adaflash, runtime)
            if self.adaflash is not None and self.adaflash.online.enabled
            else None
        )
        # Blocks whose drafter K/V retired requests left incomplete: hits on them
        # are cut while the engine does not retire (patches.py E4).
        self.holes = self._prefix_holes() if self.adaflash is not None else None
        if self._publisher is not None:  # /metrics shows zeros before any traffic
            self.round_stats.extra = self._gauges()
            self._publisher.publish(self.round_stats)
        logger.info("AdaFlash scheduler active (K=%d, config %s)", k, self.adaflash)

    def _prefix_holes(self) -> PrefixHoles | None:
        manager = getattr(self, "kv_cache_manager", None)
        groups = self.kv_cache_config.kv_cache_groups
        if manager is None or not groups:
            return None
        holes = PrefixHoles(
            [
                g.kv_cache_spec.block_size
                if getattr(g.kv_cache_spec, "prefix_cacheable", True)
                else None
                for g in groups
            ]
        )
        manager._adaflash_holes = holes
        return holes

    @override
    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        saved = (self.max_num_active_reqs, self.max_num_scheduled_tokens)
        if self.admission is not None:
            self.max_num_active_reqs, self.max_num_scheduled_tokens = (
                self.admission.limits(len(self.running), *saved)
            )
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs, self.max_num_scheduled_tokens = saved
        if self.admission is not None:
            self.admission.observe_schedule(output)
        if self.online is not None:
            self.online.poll()
            # Only a step that runs the model reaches the workers' swap hook.
            if output.total_num_scheduled_tokens > 0:
                order = self.online.take_order()
                if order is not None:
                    output.adaflash_swap = order
        return output

    @override
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        # Before super(): it truncates finished requests' token lists in place.
        if scheduler_output.scheduled_spec_decode_tokens or self.online is not None:
            before = self._decode_rounds_before(scheduler_output)
            self._record_rounds(before, model_runner_output)
            requests = [request for request, _, _ in before.values()]
        else:  # no request verifies a draft (the gate skipped), no log to keep
            requests = self._record_rounds_without_drafts(
                scheduler_output, model_runner_output
            )
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.online is not None and hasattr(scheduler_output, "adaflash_swap"):
            self.online.on_swap_result(
                getattr(model_runner_output, "adaflash_swap_result", None)
            )
        finished = self._forget_finished(requests)
        carried = getattr(model_runner_output, "adaflash_drafts", None)
        if carried is not None:  # the worker sent this step's drafts along
            if carried[0] is not None:
                self.update_draft_token_ids(carried[0])
            self._took_drafts = True
        self._gate = getattr(model_runner_output, "adaflash_gate", None) or self._gate
        holes = getattr(model_runner_output, "adaflash_holes", None)
        if holes is not None and self.holes is not None:
            self.holes.update(*holes)
        if self.admission is not None:
            self.admission.end_step(len(requests))
        if self._publisher is not None:
            # Publish at once when the last request ends, so a client that reads
            # /metrics right after its response sees its rounds. Under load,
            # where requests end every few steps, the interval holds (a snapshot
            # is a file write of about 0.5 ms: at 0.25 s, 0.3 ms per step at 32
            # requests under profile_step.py). The gauges are gathered only for
            # a snapshot.
            idle = finished > 0 and not self.has_unfinished_requests()
            if self._publisher.due(force=idle):
                self.round_stats.extra = self._gauges(fresh=idle)
                self._publisher.publish(self.round_stats)
        return outputs

    def _gauges(self, fresh: bool = False) -> dict:
        """The gauges and counters /metrics shows next to the rounds: the
        worker's draft gate, retirement's prefix cuts, admission, online (those
        recomputed at most every 0.5 s unless `fresh`: the snapshot when the
        last request ends shows them as they are)."""
        extra = dict(self._gate)
        if self.holes is not None and "retired_requests" in extra:
            extra.update(self.holes.counters())
        if self.admission is not None:
            extra.update(self.admission.gauges())
        if self.online is not None:
            extra.update(self.online.gauges_if_due(fresh))
        return extra

    def took_drafts_from_output(self) -> bool:
        """Whether the last step's drafts came with its output (then the engine
        core skips its extra `take_draft_token_ids` call: patches.py E3). Once."""
        took, self._took_drafts = self._took_drafts, False
        return took

    def _decode_rounds_before(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, tuple[Request, int, int | None]]:
        """req_id -> (request, position, k) for each request scheduled in this step;
        k is None when the step is a prefill chunk, not a round."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        rounds = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue
            # A round verifies drafts proposed after the request's previous token;
            # prefill chunks (no output yet) are not rounds.
            k = len(spec.get(req_id, ())) if request.num_output_tokens > 0 else None
            rounds[req_id] = (request, request.num_tokens, k)
        return rounds

    def _record_rounds_without_drafts(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """`_record_rounds` for a step where no request verifies a draft and no
        online log is kept (under load most steps: the gate skips): each decode
        request that sampled a token is a round of k = 0, counted at once.
        Returns the step's requests."""
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        get = self.requests.get
        requests, rounds = [], 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = get(req_id)
            if request is None:
                continue
            requests.append(request)
            if request.num_output_tokens > 0:  # else a prefill chunk, not a round
                i = index.get(req_id)
                rounds += bool(sampled and i is not None and sampled[i])
        if rounds:
            self.round_stats.observe_rounds_without_drafts(rounds)
            if self.admission is not None:
                self.admission.observe_rounds_without_drafts(rounds)
        return requests

    def _record_rounds(
        self,
        before: dict[str, tuple[Request, int, int | None]],
        model_runner_output: ModelRunnerOutput,
    ) -> None:
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        rounds = self.rounds if self.online is not None else None  # for its log
        drafts, accepted = [], []  # this step's rounds, for the counters
        for req_id, (_, position, k) in before.items():
            i = index.get(req_id)
            generated = sampled[i] if (sampled and i is not None) else None
            if k is None or not generated:  # prefill, or discarded (preempted)
                continue
            a = min(len(generated) - 1, k)
            if rounds is not None:
                log = rounds.get(req_id)
                if log is None:
                    log = rounds[req_id] = RequestRounds()
                log.add(position, k, a)
            drafts.append(k)
            accepted.append(a)
        if not drafts:
            return
        self.round_stats.observe_rounds(drafts, accepted)
        if self.admission is not None:
            self.admission.observe_rounds(drafts)
        if self.online is not None:  # the regression gate judges drafts only
            for k, a in zip(drafts, accepted, strict=True):
                if k > 0:
                    self.online.observe_round(a)

    def _forget_finished(self, requests: list[Request]) -> int:
        finished = 0
        for request in requests:
            if request.is_finished():
                self.on_request_finished(request)
                finished += 1
        return finished

    def on_request_finished(self, request: Request) -> None:
        """Called once per finished request; drops its rounds."""
        self.round_stats.requests_finished += 1
        rounds = self.rounds.pop(request.request_id, None)
        if self.online is not None:
            self.online.log_request(request, rounds)

    @override
    def finish_requests(self, request_ids, finished_status) -> list[Request]:
        aborted = super().finish_requests(request_ids, finished_status)
        for request in aborted:
            self.on_request_finished(request)
        return aborted

    @override
    def shutdown(self) -> None:
        extra = self._gauges()
        if self.online is not None:
            extra.update(self.online.gauges())
            self.online.shutdown()
        self.round_stats.extra = extra
        if self._publisher is not None:
            self._publisher.publish(self.round_stats)
        super().shutdown()
