"""Wall-clock time per engine step of AdaFlash's per-step functions, in the
running engine: a timer around each named method (worker, drafter, rejection
sampler, draft gate, block length, scheduler), one request at a time.

cProfile adds its own cost to every Python call, which inflates exactly this
kind of code (many small calls per step) several times over; a sampling
profiler cannot name a 10 us call. These timers cost ~0.3 us per call. In the
engine each of these runs after the model's forward has filled the caches, and
costs ~3x what a micro-benchmark of the same call says.

Run (about 2 minutes on one core; `--config dflash:5` for stock DFlash's parts):
    taskset -c 0 python examples/step_timers.py --config adaflash --num-prompts 40
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time

from compare_no_draft import _engine, demo_prompts

ACC: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])

RUNNER = (
    "execute_model",
    "sample_tokens",
    "_prepare_inputs",
    "_calc_spec_decode_metadata",
    "_bookkeeping_sync",
    "propose_draft_token_ids",
    "take_draft_token_ids",
)
DRAFTER = (
    "propose",
    "propose_early",
    "_open_step",
    "_observe_step_cost",
    "_record_block_round",
    "_credit_round",
    "_remember_propose",
    "_sample_draft_tokens",
)
SAMPLER = ("forward", "_record", "stats", "accepted_total")
GATE = ("should_draft", "record_round")
BLOCK = ("next_length", "record_round")
SCHEDULER = (
    "schedule",
    "update_from_output",
    "_decode_rounds_before",
    "_record_rounds",
    "_forget_finished",
)


def timed(obj, names, prefix: str) -> None:
    """Wrap each of `names` that `obj` has with a timer (on the instance)."""
    for name in names:
        orig = getattr(obj, name, None)
        if orig is None:
            continue

        def wrapper(*a, _orig=orig, _label=f"{prefix}.{name}", **k):
            t = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                entry = ACC[_label]
                entry[0] += 1
                entry[1] += time.perf_counter() - t

        setattr(obj, name, functools.wraps(orig)(wrapper))


def install(worker) -> bool:
    runner = worker.model_runner
    drafter = runner.drafter
    timed(runner, RUNNER, "runner")
    timed(drafter, DRAFTER, "proposer")
    timed(runner.rejection_sampler, SAMPLER, "sampler")
    for attr, names, prefix in (
        ("draft_gate", GATE, "gate"),
        ("block_length", BLOCK, "block"),
        ("cost_model", ("observe",), "cost"),
        ("_position_survival", ("update",), "survival"),
    ):
        part = getattr(drafter, attr, None)
        if part is not None:
            timed(part, names, prefix)
    return True


def report(steps: int) -> list[dict]:
    return [
        {
            "function": name,
            "calls_per_step": calls / steps,
            "us_per_step": 1e6 * secs / steps,
            "us_per_call": 1e6 * secs / max(calls, 1),
        }
        for name, (calls, secs) in sorted(ACC.items(), key=lambda kv: -kv[1][1])
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="adaflash", help="as compare_no_draft.py")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--skip", type=int, default=100, help="prompts left out first")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", help="also write the table as JSON here")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: one request
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm import tqdm
    from vllm import SamplingParams

    llm = _engine(args.config, 1)
    llm.collective_rpc(install)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    timed(scheduler, SCHEDULER, "scheduler")
    tokenizer = llm.get_tokenizer()
    prompts = demo_prompts(tokenizer)[args.skip : args.skip + args.num_prompts + 1]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, not counted
    ACC.clear()
    for prompt in tqdm(prompts[1:], desc="prompts"):  # one request at a time
        llm.generate([prompt], params, use_tqdm=False)
    steps = ACC["runner.execute_model"][0]
    rows = report(steps)
    print(f"{args.config}: {steps} steps at one request")
    for r in rows:
        print(
            f"{r['function']:36s} {r['calls_per_step']:5.2f} calls/step "
            f"{r['us_per_step']:9.1f} us/step {r['us_per_call']:8.1f} us/call"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "steps": steps, "rows": rows}, f)


if __name__ == "__main__":
    main()
