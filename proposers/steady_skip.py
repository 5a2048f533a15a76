"""Skipped steps in the steady skipping state, on a short path.

Under load on the CPU demo the draft gate skips 96-99% of the steps and the
engine retires every request from drafting (retired_context.py): no step
drafts, none keeps the drafter's context K/V. Each skipped step still ran the
whole propose opening (proposer.py `_open_step`): the cost curve's refresh, the
round credited to the gate, the gate's verdict for each batch-size bucket, the
checks of who is retired. At 16-32 requests that was ~100-130 us of an 8-15 ms
step (BENCHMARKS.md runs 39, 42), and none of it could change the verdict until
the bucket's next check of drafting comes due.

`SteadySkip` is that state: entered after a skipped step of at least
`MIN_BATCH` requests at which the engine retires, the gate follows skipping,
explores nothing and waits for no check, and its next check is at least one
step away. While it holds, a skipped step only counts itself on the gate (its
step, skipped-step and bucket-visit counters stay exact), marks the cache
blocks its requests' tokens left without drafter K/V (exact, as a full
skipped step does), credits its round and times itself. A decode step of the
last step's batch whose tokens all land in the blocks of the requests' last
tokens (marked already: `quiet`, counted down from the offsets of the last
slots read) reads no cache slot at all; at block size 128 that is most steps.
The state holds while the batch stays in the bucket, has not shrunk by a
quarter since the bucket's last switch (which checks drafting at once), has
not moved by a quarter from where the gate's long-run rate restarted, and
the bucket's next check is not due: every case in which the gate's verdict
could differ from "skip" makes the next step a full one. The engine keeps
retiring through the stretch: the gate's rates, which decide whether it
skips decisively, move when the state ends (full steps stop retiring
whenever a round leaves skipping's lead under `retire_margin`, and keep the
upkeep of the requests that arrive then).

What full skipped steps learn, the steady state learns once, when it ends
(`fold`): its rounds enter the gate as that many skipped rounds at once,
weighted alike (skipping's rate, and its noise from the spread of their
per-round rates: `DraftGate.record_skipped_rounds`); the steps that ran the
decode batch of the step before enter the cost curve as one step of their
mean time; the short path's own time becomes the gate's context-only time.
A round whose batch changed (a request finished, one arrived with its prompt)
is credited as a full step credits it (the proposer's `_credit_round`: a
prompt's forward taken out with the cost curve), so that skipping's rate and
its noise come from the same rounds as without the short path: from rounds
with an unchanged batch only (a first version) the noise read lower, and the
gate at 16 requests switched to drafting 1-2 times per 1,500 steps where it
did not without (BENCHMARKS.md run 43). The gate decides its next check from
skipping's rate as the steady stretch measured it.

Pure bookkeeping on the host: no tensors, no vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaflash_vllm.proposers.draft_gate import BatchSizeGates, DraftGate, batch_bucket

# Fewer requests than this never take the short path. Below 8 the gate checks
# drafting every 16 steps per request (its stretches of skipping are short) and
# follows a few requests' text round by round; there a version that entered at
# every batch size read 0.882 of plain at two requests on code where full steps
# read 0.939 (one twin's gate drafted 71% of the steps, losing; BENCHMARKS.md
# run 43), and the short path saves least.
MIN_BATCH = 8


@dataclass
class SteadySkip:
    """The steady skipping state of one bucket's gate (see the module)."""

    gates: BatchSizeGates
    gate: DraftGate  # gates.current when entered
    bucket: int
    req_ids: list[str]  # the last step's batch, in the runner's order
    started: float  # perf_counter when the last step's propose started ...
    ended: float  # ... and ended
    steps: int = 0  # short-path steps so far
    # rounds credited (their tokens emitted and ms, start to start, a changed
    # batch's prompts taken out; the sums of their rates in tokens per ms and
    # of its square), for the skipping rate and its noise
    rounds: int = 0
    round_tokens: float = 0.0
    round_ms: float = 0.0
    rate_sum: float = 0.0
    rate_sq_sum: float = 0.0
    # decode steps that ran the batch of the step before (tokens, ms from the
    # last propose's end to this one's start), for the cost curve
    costed: int = 0
    costed_tokens: int = 0
    costed_ms: float = 0.0
    propose_ms: float = 0.0  # the short path's own time, all steps
    # decode steps of the last step's batch still to come whose tokens land in
    # blocks marked already (`RetiredContext.steps_in_marked_blocks`): those
    # steps read no cache slot at all
    quiet: int = 0

    @classmethod
    def enter(
        cls,
        gates: object,
        *,
        req_ids: list[str],
        started: float,
        ended: float,
    ) -> SteadySkip | None:
        """The state after a full skipped step whose requests all retired, or
        None where the gate is not steady (see the module)."""
        gate = getattr(gates, "current", None)
        if (
            not isinstance(gates, BatchSizeGates)
            or gate is None
            or len(req_ids) < MIN_BATCH
        ):
            return None
        if (
            gate.drafting
            or gate.check_waiting
            or gate.exploring_until > gate.step
            or gate.step + 1 >= gate.explore_at
        ):
            return None
        bucket = batch_bucket(len(req_ids)) if gates.per_batch_size else 0
        return cls(gates, gate, bucket, req_ids, started, ended)

    def holds(self, num_reqs: int) -> bool:
        """Whether the step about to run, of `num_reqs` requests, would skip with
        nothing learnt that could change that (else it runs in full)."""
        gates, gate = self.gates, self.gate
        bucket = batch_bucket(num_reqs) if gates.per_batch_size else 0
        return (
            bucket == self.bucket
            and num_reqs >= MIN_BATCH
            and not gate.drafting
            and 4 * num_reqs > 3 * gate.switch_batch  # else: "batch_shrank"
            and 3 * gate.slow_batch <= 4 * num_reqs <= 5 * gate.slow_batch
            and gate.step + 1 < gate.explore_at  # else: a check of drafting
        )

    def skip(
        self, req_ids: list[str], num_tokens: int, started: float, same_batch: bool
    ) -> None:
        """Count a short-path step on the gate, as its `should_draft` would a
        skipped one, and keep its round and cost for `fold`. `num_tokens`: the
        tokens the target ran since the last propose; `started`: perf_counter
        at this propose's start; `same_batch`: the requests are the last
        step's (else the caller credits the round: `record_round`)."""
        gates, gate = self.gates, self.gate
        gate.step += 1
        gate.skipped_steps += 1
        gates.steps += 1
        gate.seen_at = gates.steps
        if same_batch:  # the last round: one token per request (k = 0)
            self.record_round(
                drafted=False,
                tokens=len(self.req_ids),
                ms=1e3 * (started - self.started),
            )
            if num_tokens == len(req_ids):  # a decode step, its forward since
                self.costed += 1  # the last propose ended
                self.costed_tokens += num_tokens
                self.costed_ms += started - self.ended
        self.steps += 1
        self.req_ids, self.started = req_ids, started

    def record_round(self, *, drafted: bool, tokens: float, ms: float) -> None:
        """A skipped round, kept for `fold` (the gate's `record_round`
        signature: the proposer's `_credit_round` credits rounds whose batch
        changed here)."""
        if ms <= 0 or drafted:
            return
        rate = tokens / ms
        self.rounds += 1
        self.round_tokens += tokens
        self.round_ms += ms
        self.rate_sum += rate
        self.rate_sq_sum += rate * rate

    def end_step(self, ended: float) -> None:
        """The short path's step is over (`ended`: perf_counter)."""
        self.propose_ms += ended - self.started
        self.ended = ended

    def fold(self, cost_model) -> None:
        """Leave the steady state: what its steps measured enters the gate (its
        rounds, as that many skipped rounds weighted alike) and the cost curve
        and the gate's context-only time (one observation of the means each;
        see the module)."""
        gate = self.gate
        n = self.rounds
        if n:
            gate.record_skipped_rounds(
                rounds=n,
                tokens=self.round_tokens / n,
                ms=self.round_ms / n,
                rate=self.rate_sum / n,
                rate_sq=self.rate_sq_sum / n,
            )
        if self.costed and cost_model is not None:
            n = round(self.costed_tokens / self.costed)
            if n <= cost_model.sizes[-1]:
                cost_model.observe(n, 1e3 * self.costed_ms / self.costed)
        if self.steps:
            gate.record_skip(1e3 * self.propose_ms / self.steps)
