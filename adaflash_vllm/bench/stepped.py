"""Engines stepped in turn: several in-process engines (`VLLM_ENABLE_V1_
MULTIPROCESSING=0`) take single steps one after the other, so that a slow spell of
a shared machine lands on all of them within milliseconds, not on one engine's
round of paired rounds (`paired.py`), whose ratios swing by 5-15% per round here.

Each engine keeps `concurrency` requests in flight from the same seeded stream
(a finished request is replaced by the next one). Used by
`examples/compare_steps.py`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from adaflash_vllm.bench.paired import mean_ci


def _greedy_delta(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,  # each step's output: its new tokens
    )


@dataclass
class Step:
    batch: int  # requests in flight when the step started
    new_prompt: bool  # a request was added since the step before
    seconds: float
    tokens: int  # output tokens the step emitted


@dataclass
class Stream:
    """One engine's requests: always `concurrency` in flight, request i being
    prompt i and output length i of the (cycled) lists, in every engine alike.
    `adaflash`: before each step, tell the engine how long it sat idle (the
    `adaflash_exclude_gap` RPC), so that its draft gate and cost curve leave the
    other engines' steps out."""

    name: str
    llm: object  # vllm.LLM, in-process
    concurrency: int
    prompts: list[str]
    lengths: list[int]
    adaflash: bool = False
    profile: object | None = None  # a cProfile.Profile for this engine's steps
    make_params: Callable[[int], object] = _greedy_delta  # max_tokens -> params
    clock: Callable[[], float] = time.perf_counter
    steps: list[Step] = field(default_factory=list)
    # at one request: each finished request's seconds (the steps it ran in)
    per_request: dict[int, float] = field(default_factory=dict)
    next_id: int = 0
    running: int = 0
    _new_prompt: bool = False
    _ended_at: float | None = None
    _request_secs: float = 0.0

    def fill(self) -> None:
        while self.running < self.concurrency:
            i = self.next_id
            self.llm.llm_engine.add_request(
                f"{self.name}-{i}",
                self.prompts[i % len(self.prompts)],
                self.make_params(self.lengths[i % len(self.lengths)]),
            )
            self.next_id += 1
            self.running += 1
            self._new_prompt = True

    def step(self) -> None:
        """One engine step (then refill)."""
        if self.adaflash and self._ended_at is not None:
            gap = self.clock() - self._ended_at
            self.llm.collective_rpc("adaflash_exclude_gap", args=(gap,))
        batch, new = self.running, self._new_prompt
        self._new_prompt = False
        if self.profile is not None:
            self.profile.enable()
        started = self.clock()
        outs = self.llm.llm_engine.step()
        self._ended_at = self.clock()
        if self.profile is not None:
            self.profile.disable()
        secs, tokens = self._ended_at - started, 0
        self._request_secs += secs
        for out in outs:
            tokens += len(out.outputs[0].token_ids)
            if out.finished:
                self.running -= 1
                if self.concurrency == 1:
                    self.per_request[self.request_index(out.request_id)] = (
                        self._request_secs
                    )
                    self._request_secs = 0.0
        self.steps.append(Step(batch, new, secs, tokens))
        self.fill()

    def request_index(self, request_id: str) -> int:
        """i of "NAME-i" (vLLM may append "-suffix" to the id it was given)."""
        return int(request_id[len(self.name) + 1 :].split("-")[0])

    def tok_s(self, skip: int = 0) -> float:
        steps = self.steps[skip:]
        return sum(s.tokens for s in steps) / sum(s.seconds for s in steps)

    def median_step_ms(self, skip: int, new_prompt: bool) -> float | None:
        """Median time of the steps (after `skip`) at the full batch that did or
        did not run a new prompt."""
        times = [
            s.seconds
            for s in self.steps[skip:]
            if s.batch == self.concurrency and s.new_prompt == new_prompt
        ]
        return 1e3 * statistics.median(times) if times else None


def step_in_turn(streams: list[Stream], steps: int, progress=None) -> None:
    """`steps` steps of every stream, one stream at a time, the order reversing
    every step (no engine always steps right after the same other one)."""
    for s in streams:
        s.fill()
    for i in progress(range(steps)) if progress is not None else range(steps):
        for s in streams if i % 2 == 0 else reversed(streams):
            s.step()


def block_ratios(num: Stream, den: Stream, skip: int, block: int) -> list[float]:
    """tok/s of `num` over `den` per block of `block` steps after the first
    `skip` (the same steps in turn, so the same stretch of wall time)."""
    a, b = num.steps[skip:], den.steps[skip:]
    out = []
    for i in range(0, min(len(a), len(b)) - block + 1, block):
        ta, tb = a[i : i + block], b[i : i + block]
        rate_a = sum(s.tokens for s in ta) / sum(s.seconds for s in ta)
        rate_b = sum(s.tokens for s in tb) / sum(s.seconds for s in tb)
        out.append(rate_a / rate_b)
    return out


def request_ratios(num: Stream, den: Stream) -> list[float]:
    """At one request: each request both finished (but the first, which ran
    while the engines warmed up), its time in `den` over its time in `num`: a
    tok/s ratio on the same prompt and tokens (greedy)."""
    common = sorted(set(num.per_request) & set(den.per_request))[1:]
    return [den.per_request[i] / num.per_request[i] for i in common]


def ratio_summary(ratios: list[float], unit: str) -> dict[str, float]:
    """Mean with a 95% half-width and median, and how many (`unit`) there were."""
    if not ratios:
        nan = float("nan")
        return {
            unit: 0,
            "tok_s_ratio_mean": nan,
            "tok_s_ratio_ci95": nan,
            "tok_s_ratio_median": nan,
        }
    m, h = mean_ci(ratios)
    return {
        unit: len(ratios),
        "tok_s_ratio_mean": m,
        "tok_s_ratio_ci95": h,
        "tok_s_ratio_median": statistics.median(ratios),
    }
