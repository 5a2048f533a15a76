"""Offline benchmark runner: one configuration, one workload, one `LLM`, in a child
process (so every configuration starts from a fresh engine on the same cores).

Run (the harness does this): python -m adaflash_vllm.bench.offline JOB.json
JOB.json: {"target", "config": {name, speculative_config}, "workload": {...},
           "setup": {...}, "engine": {extra LLM kwargs}, "out": result path,
           "command": str, "warmup": int}
A shift stream runs through at once; a sweep takes its passes as commands on
stdin, so that the harness can interleave every configuration's
(`SweepLevels.run_commands`, offline_interleaved.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median
from typing import Any

from adaflash_vllm.bench.results import (
    Point,
    add_point,
    new_result,
    save_result,
)

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "rounds": "vllm:adaflash_rounds",
    "verified": "vllm:adaflash_verified_tokens",
    "ada_accepted": "vllm:adaflash_accepted_tokens",
    "spec_rounds": "vllm:adaflash_speculative_rounds",
    "spec_verified": "vllm:adaflash_speculative_verified_tokens",
}
GAUGES = {  # AdaFlash state exported as gauges (absent where the feature is off)
    "drafter_version": "vllm:adaflash_drafter_version",
    "swaps_total": "vllm:adaflash_swaps_total",
    # the draft gate's counters (absent without skip_drafting)
    "gate_drafted": "vllm:adaflash_draft_gate_drafted_steps",
    "gate_skipped": "vllm:adaflash_draft_gate_skipped_steps",
}
VECTORS = {
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
    "ada_drafted_per_pos": "vllm:adaflash_drafted_tokens_per_pos",
    "ada_accepted_per_pos": "vllm:adaflash_accepted_tokens_per_pos",
}


def read_counters(llm) -> dict[str, Any]:
    """Spec-decode and AdaFlash counters from the engine (cumulative)."""
    found: dict[str, Any] = {k: 0 for k in COUNTERS}
    found.update({k: [] for k in VECTORS})
    by_name = {v: k for k, v in (COUNTERS | GAUGES).items()}
    vec_by_name = {v: k for k, v in VECTORS.items()}
    for m in llm.get_metrics():
        if m.name in by_name and hasattr(m, "value"):
            found[by_name[m.name]] = m.value
        elif m.name in vec_by_name:
            if hasattr(m, "values"):
                found[vec_by_name[m.name]] = list(m.values)
            else:
                found[vec_by_name[m.name]].append(m.value)
    return found


def counter_delta(before: dict, after: dict) -> dict[str, Any]:
    delta = {}
    for k, v in after.items():
        if isinstance(v, list):
            old = before.get(k) or [0] * len(v)
            delta[k] = [
                a - b for a, b in zip(v, old + [0] * (len(v) - len(old)), strict=False)
            ]
        else:
            delta[k] = v - before.get(k, 0)
    return delta


def swap_extra(before: dict, after: dict) -> dict[str, Any]:
    """The drafter version at the end of a window and the swaps during it."""
    if "drafter_version" not in after:
        return {}
    return {
        "drafter_version": int(after["drafter_version"]),
        "swaps": int(after.get("swaps_total", 0) - before.get("swaps_total", 0)),
    }


def gate_extra(before: dict, after: dict) -> dict[str, Any]:
    """The share of a window's steps the draft gate ran without the drafter."""
    if "gate_skipped" not in after:
        return {}
    skipped = after["gate_skipped"] - before.get("gate_skipped", 0)
    drafted = after["gate_drafted"] - before.get("gate_drafted", 0)
    if skipped + drafted == 0:
        return {}
    return {"gate_skipped_share": skipped / (skipped + drafted)}


def spec_summary(delta: dict[str, Any]) -> dict[str, Any]:
    """tau, mean verify length, rounds and per-position acceptance of a window;
    also tau and verify length over speculating steps only (steps where some
    request verified a draft; every step of stock DFlash), which leaves out the
    steps AdaFlash's draft gate ran without a draft."""
    if delta["rounds"] > 0:  # AdaFlash counts every round, k_i = 0 included
        rounds, accepted, verified = (
            delta["rounds"],
            delta["ada_accepted"],
            delta["verified"],
        )
        spec_rounds, spec_verified = delta["spec_rounds"], delta["spec_verified"]
        drafted, acc = delta["ada_drafted_per_pos"], delta["ada_accepted_per_pos"]
        per_pos = [a / d if d else 0.0 for a, d in zip(acc, drafted, strict=False)]
    elif delta["drafts"] > 0:  # stock DFlash: every round speculates
        rounds, accepted = delta["drafts"], delta["accepted"]
        verified = delta["drafts"] + delta["draft_tokens"]
        spec_rounds, spec_verified = rounds, verified
        per_pos = [a / rounds for a in delta["accepted_per_pos"]]
    else:
        return {"tau": 1.0, "verify_len": 1.0, "rounds": 0, "accept_per_pos": []}
    return {
        "tau": 1 + accepted / rounds,
        "verify_len": verified / rounds,
        "rounds": rounds,
        "accept_per_pos": per_pos,
        # Accepted tokens all come from speculating steps.
        "tau_speculative": 1 + accepted / spec_rounds if spec_rounds else None,
        "verify_len_speculative": spec_verified / spec_rounds if spec_rounds else None,
    }


def timed_generate(llm, prompts: list[str], params) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def run_shift(
    llm,
    workload: dict,
    result: dict,
    save: Callable[[], None],
    progress: Callable[[str], None],
) -> None:
    lengths = iter(stream_lengths(workload))
    for key, phase, chunk in shift_windows(workload):
        params = [stream_params(workload, next(lengths)) for _ in chunk]
        before = read_counters(llm)
        outs, wall = timed_generate(llm, chunk, params)
        after = read_counters(llm)
        summary = spec_summary(counter_delta(before, after))
        extra = swap_extra(before, after) | gate_extra(before, after)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        add_point(
            result,
            Point(
                key=key,
                phase=phase,
                requests=len(chunk),
                output_tokens=tokens,
                wall_s=wall,
                tok_s=tokens / wall,
                tok_s_runs=[tokens / wall],
                extra=extra,
                **summary,
            ),
        )
        save()
        progress(window_line(key, phase, tokens / wall, summary, extra))


def run_shift_refilled(
    llm,
    workload: dict,
    result: dict,
    save: Callable[[], None],
    progress: Callable[[str], None],
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """The shift stream queued whole, `window` requests in flight (the engine's
    `max_num_seqs`), each finished request replaced by the next: the windows,
    tok/s, tau and verify length of `RefillWindows` (the engine needs
    `per_request_spec_decode_metrics`, which `engine_kwargs` sets). Per-position
    acceptance, the gate's share and swaps are the engine's counters between the
    window before it (of its phase; for a phase's first, of any phase) coming out
    and it coming out: engine-wide, so near a phase boundary they mix both
    phases' requests. Every second between two steps counts, reading counters
    included: in a multiprocess engine the engine core keeps stepping meanwhile."""
    from vllm.sampling_params import RequestOutputKind

    from adaflash_vllm.bench.refill import RefillWindows

    names = [phase["name"] for phase in workload["phases"]]
    phase_of, prompts = [], []
    for p, phase in enumerate(workload["phases"]):
        phase_of += [p] * len(phase["prompts"])
        prompts += phase["prompts"]
    windows = RefillWindows(phase_of, workload["window"])
    engine = llm.llm_engine
    for i, (prompt, length) in enumerate(
        zip(prompts, stream_lengths(workload), strict=True)
    ):
        # DELTA: each step's output holds that step's new tokens
        params = stream_params(workload, length, output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(i), prompt, params)
    since = dict.fromkeys(range(len(names)), read_counters(llm))
    key, last = 0, clock()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = clock()
        out = windows.add_step(now - last, [step_output(o) for o in outs])
        last = now
        for w in out:
            after = read_counters(llm)
            before, since[w.phase] = since[w.phase], after
            for later in range(w.phase + 1, len(names)):
                if windows.finished[later] == 0 and windows.open[later] is None:
                    since[later] = after  # not started: its span starts here
            summary = {
                "tau": w.tau,
                "verify_len": w.verify_len,
                "rounds": w.decode_rows,
                "accept_per_pos": spec_summary(counter_delta(before, after))[
                    "accept_per_pos"
                ],
                "tau_speculative": w.tau_speculative,
                "verify_len_speculative": w.verify_len_speculative,
            }
            extra = swap_extra(before, after) | gate_extra(before, after)
            add_point(
                result,
                Point(
                    key=key,
                    phase=names[w.phase],
                    requests=w.requests,
                    output_tokens=w.tokens,
                    wall_s=w.seconds,
                    tok_s=w.tok_s,
                    tok_s_runs=[w.tok_s],
                    extra=extra,
                    **summary,
                ),
            )
            key += 1
            save()
            progress(window_line(key - 1, names[w.phase], w.tok_s, summary, extra))


def stream_params(workload: dict, max_tokens: int, **extra):
    """A benchmark request's SamplingParams: the workload's temperature,
    `max_tokens` tokens whatever the text (ignore_eos), seed 0."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=workload["temperature"],
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=0,
        **extra,
    )


def stream_lengths(workload: dict) -> list[int]:
    """Each request's output length, in stream order: `max_tokens`, or with
    `output_len_spread` drawn (seeded, the same for every configuration) from
    max_tokens * [1 - spread, 1 + spread]."""
    from adaflash_vllm.bench.workloads import output_lengths

    return output_lengths(
        sum(len(phase["prompts"]) for phase in workload["phases"]),
        workload["max_tokens"],
        workload.get("output_len_spread", 0.0),
    )


def step_output(out) -> tuple:
    """(request index, new tokens, finished, its drafts when it finished) of one
    request's output of a step (DELTA outputs; request ids are the indexes)."""
    from adaflash_vllm.bench.refill import Drafts

    completion = out.outputs[0]
    drafts = None
    metrics = completion.spec_decode_metrics if out.finished else None
    if metrics is not None:
        drafts = Drafts(
            drafted=metrics.num_draft_tokens,
            rounds=sum(metrics.histogram),
            accepted=sum(j * n for j, n in enumerate(metrics.histogram)),
        )
    index = int(out.request_id.split("-")[0])  # vLLM may add "-suffix"
    return index, len(completion.token_ids), out.finished, drafts


def shift_windows(workload: dict) -> Iterator[tuple[int, str, list[str]]]:
    """(window index, phase name, prompts) of the shift stream, in serving order."""
    key, size = 0, workload["window"]
    for phase in workload["phases"]:
        prompts = phase["prompts"]
        for start in range(0, len(prompts), size):
            yield key, phase["name"], prompts[start : start + size]
            key += 1


def window_line(key: int, phase: str, tok_s: float, summary: dict, extra: dict) -> str:
    """Progress line of one shift window (`extra`: `swap_extra` of the window)."""
    line = f"window {key} [{phase}] {tok_s:7.1f} tok/s tau {summary['tau']:.2f}"
    if "drafter_version" in extra:
        line += f" drafter v{extra['drafter_version']}"
    return line


READY = "@@ready"  # the child's engine is up (interleaved sweep protocol)
DONE = "@@done"  # the child finished a command


class SweepLevels:
    """The offline sweep in one engine: at concurrency C, `requests_per_slot`
    (4) x C requests with C in flight, a finished one replaced by the next at
    once, as C clients of `vllm serve` that each send their next request when
    their last one is answered (`serve_in_flight`; the engine's `max_num_seqs`
    is the largest C). Output lengths as the served sweep draws them
    (`output_len_spread`). The harness runs every configuration's engine at
    once and, level by level, their passes in turn (`run_commands`;
    offline_interleaved.py)."""

    def __init__(self, llm, workload: dict, result: dict, save, progress, clock=None):
        self.llm, self.workload, self.result = llm, workload, result
        self.save, self.progress = save, progress
        self.clock = clock or time.perf_counter
        self.passes: dict[int, list[tuple[float, int, dict, dict]]] = {}
        self._levels: dict[int, tuple[list[str], list]] = {}

    def _level(self, c: int) -> tuple[list[str], list]:
        """Level C's requests and their params (built once per level)."""
        if c not in self._levels:
            self._levels[c] = self._build_level(c)
        return self._levels[c]

    def _build_level(self, c: int) -> tuple[list[str], list]:
        from vllm.sampling_params import RequestOutputKind

        from adaflash_vllm.bench.workloads import output_lengths

        wl = self.workload
        prompts = wl["phases"][0]["prompts"]
        n = (wl.get("requests_per_slot") or 4) * c
        batch = (prompts * (n // max(1, len(prompts)) + 1))[:n]
        lengths = output_lengths(n, wl["max_tokens"], wl.get("output_len_spread", 0.0))
        kind = RequestOutputKind.DELTA
        return batch, [stream_params(wl, m, output_kind=kind) for m in lengths]

    def warm(self, c: int) -> None:
        """C short requests at concurrency C (as the served sweep's warm-up)."""
        from vllm.sampling_params import RequestOutputKind

        batch, _ = self._level(c)
        params = stream_params(self.workload, 8, output_kind=RequestOutputKind.DELTA)
        batch = batch[:c]
        engine = self.llm.llm_engine
        serve_in_flight(engine, batch, [params] * len(batch), c, f"warm{c}")

    def measure(self, c: int) -> None:
        """One timed pass at concurrency C."""
        batch, params = self._level(c)
        runs = self.passes.setdefault(c, [])
        before = read_counters(self.llm)
        tokens, wall = serve_in_flight(
            self.llm.llm_engine, batch, params, c, f"c{c}r{len(runs)}", self.clock
        )
        after = read_counters(self.llm)
        summary = spec_summary(counter_delta(before, after))
        runs.append((tokens / wall, tokens, summary, gate_extra(before, after)))

    def point(self, c: int) -> None:
        """Record concurrency C: the median of its passes (the last pass's tau,
        verify length and gate share)."""
        runs = self.passes.pop(c)
        rates = sorted(r[0] for r in runs)
        _, tokens, summary, extra = runs[-1]
        tok_s = median(rates)
        add_point(
            self.result,
            Point(
                key=c,
                phase=self.workload["phases"][0]["name"],
                requests=len(self._level(c)[0]),
                output_tokens=tokens,
                wall_s=tokens / tok_s,
                tok_s=tok_s,
                tok_s_runs=rates,
                extra=extra,
                **summary,
            ),
        )
        self.save()
        line = f"C={c} {tok_s:7.1f} tok/s tau {summary['tau']:.2f}"
        if "gate_skipped_share" in extra:
            line += f" gate skipped {extra['gate_skipped_share']:.0%} of steps"
        self.progress(line)

    def run_commands(self, lines, reply: Callable[[str], None]) -> None:
        """The interleaved sweep's child side: say READY, then for each JSON
        line `{"op": "warm" | "pass" | "point", "level": C}` do it and say
        DONE; stop at `{"op": "end"}` (or the end of input)."""
        reply(READY)
        for line in lines:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd["op"] == "end":
                return
            {"warm": self.warm, "pass": self.measure, "point": self.point}[cmd["op"]](
                int(cmd["level"])
            )
            reply(DONE)


def serve_in_flight(
    engine,
    prompts: list[str],
    params: list,
    concurrency: int,
    tag: str = "r",
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, float]:
    """Serve `prompts` (with `params`, DELTA outputs) on a vLLM `LLMEngine` with
    at most `concurrency` in flight: the first `concurrency` at once, then the
    next each time one finishes (request ids `TAG-i`). Returns (output tokens,
    wall seconds from the first request in to the last one out)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(enumerate(zip(prompts, params, strict=True)))
    in_flight = tokens = 0

    def submit() -> None:
        nonlocal in_flight
        while in_flight < concurrency:
            item = next(pending, None)
            if item is None:
                return
            i, (prompt, p) = item
            engine.add_request(f"{tag}-{i}", prompt, p)
            in_flight += 1

    started = clock()
    submit()
    while in_flight:
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
            in_flight -= out.finished
        submit()
    return tokens, clock() - started


def main(job_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    job = json.loads(Path(job_path).read_text())
    workload = job["workload"]
    result = new_result(
        command=job["command"],
        setup=job["setup"],
        workload=workload,
        config=job["config"],
    )

    def save() -> None:
        save_result(result, job["out"])

    def progress(msg: str) -> None:
        print(f"[{job['config']['name']}] {msg}", flush=True)

    from vllm import LLM, SamplingParams

    spec = job["config"]["speculative_config"]
    engine = dict(job["engine"])
    if spec is None:  # vLLM refuses per-request draft counts without drafts
        engine.pop("per_request_spec_decode_metrics", None)
    llm = LLM(model=job["target"], speculative_config=spec, **engine)
    try:
        warm = workload["phases"][0]["prompts"][: job.get("warmup", 4)]
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        if workload["kind"] == "shift":
            run = run_shift_refilled if workload.get("refill") else run_shift
            run(llm, workload, result, save, progress)
        else:
            # the harness interleaves the configurations' passes (stdin)
            levels = SweepLevels(llm, workload, result, save, progress)
            levels.run_commands(sys.stdin, lambda line: print(line, flush=True))
        result["status"] = "ok"
    except Exception as e:  # keep finished points, say what broke
        result["status"], result["error"] = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        save()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
