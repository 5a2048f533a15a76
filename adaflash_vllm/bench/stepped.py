"""Engines stepped in turn: several in-process engines (`VLLM_ENABLE_V1_
MULTIPROCESSING=0`) take single steps one after the other, so that a slow spell of
a shared machine lands on all of them within milliseconds, not on one engine's
round of paired rounds (`paired.py`), whose ratios swing by 5-15% per round here.

Each engine keeps `concurrency` requests in flight from the same seeded stream
(a finished request is replaced by the next one). Used by
`examples/compare_steps.py`.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
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
    episode: int = 0  # the stream's episode (`Stream.episode`; 0 without)


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
    # requests per episode (0: one steady stream): the requests of episode e are
    # e * episode ... (e + 1) * episode - 1, and the next episode starts only
    # once every request of this one finished, so each ends in a drain (the
    # batch falls to one), as traffic does between bursts
    episode: int = 0
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
            if self.episode and i % self.episode == 0 and self.running:
                return  # the episode drains first
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
        episode = (self.next_id - 1) // self.episode if self.episode else 0
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
        self.steps.append(Step(batch, new, secs, tokens, episode))
        self.fill()

    def request_index(self, request_id: str) -> int:
        """i of "NAME-i" (vLLM may append "-suffix" to the id it was given)."""
        return int(request_id[len(self.name) + 1 :].split("-")[0])

    def tok_s(self, skip: int = 0) -> float:
        return pooled_tok_s(self, skip)

    def median_step_ms(self, skip: int, new_prompt: bool) -> float | None:
        """Median time of the steps (after `skip`) at the full batch that did or
        did not run a new prompt."""
        return pooled_median_step_ms(self, skip, new_prompt)


def step_in_turn(
    streams: list[Stream], steps: int, progress=None, order: str = "shuffle"
) -> None:
    """`steps` steps of every stream, one stream at a time. `order`: "shuffle",
    a new seeded random order every step (every engine as likely to step right
    after itself, or after any other); "reverse", the order reversing every
    step (with three or more engines the first and last in the list step twice
    in a row every other step, the ones between never do)."""
    if order not in ("shuffle", "reverse"):
        raise ValueError(f"order must be 'shuffle' or 'reverse', got {order!r}")
    rng = random.Random(0)
    for s in streams:
        s.fill()
    for i in progress(range(steps)) if progress is not None else range(steps):
        if order == "shuffle":
            turn = rng.sample(streams, len(streams))
        else:
            turn = streams if i % 2 == 0 else streams[::-1]
        for s in turn:
            s.step()


Streams = Stream | Sequence[Stream]  # one engine, or twins of one configuration


def _twins(x: Streams) -> list[Stream]:
    return [x] if isinstance(x, Stream) else list(x)


def _rate(streams: list[Stream], start: int, block: int) -> float:
    steps = [st for s in streams for st in s.steps[start : start + block]]
    return sum(st.tokens for st in steps) / sum(st.seconds for st in steps)


def block_ratios(num: Streams, den: Streams, skip: int, block: int) -> list[float]:
    """tok/s of `num` over `den` per block of `block` steps after the first
    `skip` (the same steps in turn, so the same stretch of wall time). Twins of
    a configuration (engines built at mirrored places) pool their tokens and
    seconds per block."""
    nums, dens = _twins(num), _twins(den)
    n = min(len(s.steps) for s in nums + dens) - skip
    return [
        _rate(nums, skip + i, block) / _rate(dens, skip + i, block)
        for i in range(0, n - block + 1, block)
    ]


def request_ratios(num: Streams, den: Streams) -> list[float]:
    """At one request: each request every engine finished (but the first, which
    ran while the engines warmed up), its time in `den` over its time in `num`
    (twins: their mean time): a tok/s ratio on the same prompt and tokens
    (greedy)."""
    nums, dens = _twins(num), _twins(den)
    common = sorted(set.intersection(*(set(s.per_request) for s in nums + dens)))
    return [
        statistics.fmean(d.per_request[i] for d in dens)
        / statistics.fmean(n.per_request[i] for n in nums)
        for i in common[1:]
    ]


def episode_ratios(
    num: Streams, den: Streams, drain_below: int | None = None, skip: int = 1
) -> dict[int, float]:
    """Per episode (`Stream.episode`) that every engine finished, but the first
    `skip`: tok/s of `num` over `den` over its steps or, with `drain_below`,
    only over its steps at fewer requests than that (its drain: an episode
    starts with a full batch). Twins pool their tokens and seconds per
    episode. The same requests make up an episode in every engine, so unlike
    `block_ratios` the engines need not be at the same step."""
    streams = _twins(num) + _twins(den)
    # finished everywhere: a later episode has started in every engine
    done = min(s.steps[-1].episode if s.steps else 0 for s in streams)

    def rates(group: list[Stream]) -> dict[int, float]:
        sums: dict[int, list[float]] = {}
        for s in group:
            for st in s.steps:
                if not skip <= st.episode < done:
                    continue
                if drain_below is not None and st.batch >= drain_below:
                    continue
                acc = sums.setdefault(st.episode, [0.0, 0.0])
                acc[0] += st.tokens
                acc[1] += st.seconds
        return {e: t / sec for e, (t, sec) in sums.items() if t > 0 and sec > 0}

    nums, dens = rates(_twins(num)), rates(_twins(den))
    return {e: nums[e] / dens[e] for e in sorted(set(nums) & set(dens))}


def pooled_tok_s(streams: Streams, skip: int = 0) -> float:
    """Output tok/s over every step after `skip` of one engine or its twins."""
    steps = [st for s in _twins(streams) for st in s.steps[skip:]]
    return sum(st.tokens for st in steps) / sum(st.seconds for st in steps)


def pooled_median_step_ms(
    streams: Streams, skip: int, new_prompt: bool
) -> float | None:
    """`Stream.median_step_ms` over one engine's or its twins' steps."""
    times = [
        st.seconds
        for s in _twins(streams)
        for st in s.steps[skip:]
        if st.batch == s.concurrency and st.new_prompt == new_prompt
    ]
    return 1e3 * statistics.median(times) if times else None


def twin_build_order(configs: Sequence[str]) -> list[str]:
    """Each configuration built twice, the second time in reverse order
    (`A B C C' B' A'`): engines built later in a process step a little faster,
    and over mirrored places that cancels for every configuration alike. The
    twin of `c` is named `c#2`."""
    return list(configs) + [f"{c}{_TWIN}" for c in reversed(configs)]


_TWIN = "#2"


def config_of(engine: str) -> str:
    """The configuration an engine of `twin_build_order` runs."""
    return engine.removesuffix(_TWIN)


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
