"""Wall-clock time per engine step of AdaFlash's per-step functions, in the
running engine: a timer around each named method (worker, drafter, rejection
sampler, draft gate, block length, scheduler), one request at a time or
`--concurrency` N prompts per batch.

cProfile adds its own cost to every Python call, which inflates exactly this
kind of code (many small calls per step) several times over; a sampling
profiler cannot name a 10 us call. These timers cost ~0.3 us per call. In the
engine each of these runs after the model's forward has filled the caches, and
costs ~3x what a micro-benchmark of the same call says.

Several configurations in one run (`--configs adaflash,dflash:5`) take every
prompt in turn, in an order reversed each prompt, so that the machine's speed
swings land on all of them alike; the table then has one column per
configuration. Besides compare_no_draft.py's configurations, `no_draft:noctx`
never drafts and skips the drafter's context upkeep too, and `no_draft:eager`
writes that upkeep at every step instead of batching it. `--twins` builds each
configuration twice at mirrored places and pools the pair: the place an engine
is built at moves all of its timings (run 33), not only AdaFlash's parts.
Run (about 4 minutes on one core for two):
    taskset -c 0 python examples/step_timers.py --configs adaflash,dflash:5 \
        --num-prompts 40
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time

from compare_no_draft import _engine, demo_prompts, in_process_engines

ACC: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # "config/part.fn"

RUNNER = (
    "execute_model",
    "sample_tokens",
    "_prepare_inputs",
    "_calc_spec_decode_metadata",
    "_build_attention_metadata",
    "_model_forward",
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
    "_write_deferred_context",
    "_skip_drafting",
    "_skip_steadily",
    "_leave_steady",
    "_retire_rows",
    "_every_row_retired",
    "note_schedule",
    "take_holes",
    "set_inputs_first_pass",
    "build_per_group_and_layer_attn_metadata",
    "build_model_inputs_first_pass",
    "_round_history",
    "_sample_draft_tokens",
    "_cap_block",
    "_synced_clock",
)
SAMPLER = ("forward", "_record", "stats", "accepted_total")
GATE = ("should_draft", "record_round")
BLOCK = ("next_length", "record_round", "record_budgets")
SCHEDULER = (
    "schedule",
    "update_from_output",
    "_decode_rounds_before",
    "_record_rounds_without_drafts",
    "_record_rounds",
    "_forget_finished",
)


def charge(label: str, started: float) -> None:
    """One call of `label` that began at perf_counter `started`."""
    entry = ACC[label]
    entry[0] += 1
    entry[1] += time.perf_counter() - started


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
                charge(_label, t)

        setattr(obj, name, functools.wraps(orig)(wrapper))


def by_tokens(runner, label: str) -> None:
    """Time the runner's `execute_model` (the target's forward) also by the
    step's scheduled token count: steps of 1 + k tokens for each k verified."""
    orig = runner.execute_model

    def execute_model(scheduler_output, *a, **k):
        t = time.perf_counter()
        try:
            return orig(scheduler_output, *a, **k)
        finally:
            n = scheduler_output.total_num_scheduled_tokens
            charge(f"{label}/forward at {n:3d} tokens", t)

    runner.execute_model = execute_model


def install(worker, config: str) -> bool:
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)  # None: plain vLLM
    by_tokens(runner, config)
    timed(runner, RUNNER, f"{config}/runner")
    if drafter is None:
        return True
    timed(drafter, DRAFTER, f"{config}/proposer")
    timed(runner.rejection_sampler, SAMPLER, f"{config}/sampler")
    for attr, names, prefix in (
        ("draft_gate", GATE, "gate"),
        ("block_length", BLOCK, "block"),
        ("_position_survival", ("update",), "survival"),
        ("budget_policy", ("choose", "allocate"), "policy"),
        ("_deferred", ("add", "write"), "deferred"),
        (
            "model",
            ("forward", "compute_logits", "precompute_and_store_context_kv"),
            "drafter_model",
        ),
    ):
        part = getattr(drafter, attr, None)
        if part is not None:
            timed(part, names, f"{config}/{prefix}")
    profile = getattr(drafter, "ensure_cost_profile", None)
    if profile is not None:  # the step-cost curve exists once it has run

        def ensure_cost_profile(runner, _orig=profile):
            _orig(runner)
            cost = drafter.cost_model
            if cost is not None and not hasattr(cost, "_timed"):
                cost._timed = True
                timed(cost, ("observe",), f"{config}/cost")

        drafter.ensure_cost_profile = ensure_cost_profile
    head = getattr(getattr(drafter.budget_policy, "survival", None), "head", None)
    if head is not None:  # the length head's own forward
        timed(head, ("survival", "ratio"), f"{config}/head")
    use = getattr(getattr(drafter, "budget_policy", None), "use", None)
    if use is not None:
        timed(use, ("active", "record"), f"{config}/budget_use")
    return True


def _write_every_step(worker) -> None:
    """`no_draft:eager`: the skipped steps' context K/V written at each step, not
    queued for one batched write (proposer.MAX_DEFERRED_TOKENS)."""
    worker.model_runner.drafter._deferred.limit = 1


def budget_use_summary(worker) -> dict | None:
    """BudgetUse's per-bucket gain and overhead (None: no cost_aware policy)."""
    policy = getattr(
        getattr(worker.model_runner, "drafter", None), "budget_policy", None
    )
    use = getattr(policy, "use", None)
    return None if use is None else use.to_dict()


def gate_summary(worker) -> dict | None:
    """The draft gate's counters per batch-size bucket (None: no gate)."""
    gate = getattr(getattr(worker.model_runner, "drafter", None), "draft_gate", None)
    if gate is None:
        return None
    keys = ("drafted_steps", "skipped_steps", "switches", "explorations")
    keys += ("predicted_checks", "predicted_switches")
    buckets = gate.to_dict().get("buckets")
    if buckets is None:  # a scripted gate (no_draft): no buckets
        return None
    return {b: {k: g[k] for k in keys} for b, g in buckets.items()}


def report(configs: list[str], steps: dict[str, int]) -> list[dict]:
    """One row per function: each configuration's us per step and calls per step."""
    names: dict[str, float] = {}
    for label, (_, secs) in ACC.items():
        config, _, name = label.partition("/")
        names[name] = max(names.get(name, 0.0), secs / max(steps[config], 1))
    rows = []
    for name in sorted(names, key=lambda n: -names[n]):
        row = {"function": name}
        for config in configs:
            calls, secs = ACC.get(f"{config}/{name}", (0, 0.0))
            row[config] = {
                "calls_per_step": calls / max(steps[config], 1),
                "us_per_step": 1e6 * secs / max(steps[config], 1),
                "us_per_call": 1e6 * secs / max(calls, 1),
            }
        rows.append(row)
    return rows


def print_table(title: str, rows, configs, value: str = "us_per_step") -> None:
    """`rows` (as `report` gives them): `value` and calls per step, by config."""
    print(f"{title:36s}" + "".join(f"{c:>22s}" for c in configs))
    for r in rows:
        cells = "".join(
            f"{r[c][value]:13.1f} ({r[c]['calls_per_step']:4.2f}/st)" for c in configs
        )
        print(f"{r['function']:36s}{cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs", default="adaflash", help="comma list, as compare_no_draft.py"
    )
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="prompts per batch (each engine serves this many at a time)",
    )
    p.add_argument("--skip", type=int, default=100, help="prompts left out first")
    p.add_argument(
        "--domain",
        default="prose",
        choices=("prose", "math", "code"),
        help="the demo's prompts of this domain (code: one the drafter serves badly)",
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", help="also write the table as JSON here")
    p.add_argument(
        "--twins",
        action="store_true",
        help="build every configuration twice at mirrored places and pool the pair",
    )
    args = p.parse_args()
    in_process_engines(1)  # GiB per engine (2 for 64 requests of 1,024 tokens)
    from tqdm import tqdm
    from vllm import SamplingParams

    from adaflash_vllm.bench.stepped import config_of, twin_build_order

    configs = args.configs.split(",")
    # AdaFlash's worker patches, applied when its first engine is built, make
    # stock DFlash engines built before it fail the runner's isinstance check
    # (compare_steps.py): a spare AdaFlash engine first, never stepped.
    first = configs[0]
    spare = _engine("adaflash", 1) if not first.startswith("adaflash") else None
    # Engines built later in a process step at their own speed (BENCHMARKS.md
    # runs 25, 33): `--twins` builds each configuration twice at mirrored places
    # (A B B' A') and pools each pair's timers under the configuration's name.
    names = twin_build_order(configs) if args.twins else configs
    engines = {}
    for name in names:
        config = config_of(name)
        llm = engines[name] = _engine(
            config.partition(":")[0] if config.startswith("no_draft") else config,
            args.concurrency,
        )
        if config == "no_draft:noctx":  # never drafting, without the context upkeep
            llm.collective_rpc("adaflash_debug_context_upkeep", args=(False,))
        if config == "no_draft:eager":  # never drafting, upkeep written every step
            llm.collective_rpc(_write_every_step)
        llm.collective_rpc(install, args=(config,))
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        timed(scheduler, SCHEDULER, f"{config}/scheduler")
    tokenizer = engines[names[0]].get_tokenizer()
    conc = args.concurrency
    prompts = demo_prompts(tokenizer, args.domain)
    prompts = (prompts * (1 + (args.skip + conc + args.num_prompts) // len(prompts)))[
        args.skip : args.skip + conc + args.num_prompts
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:conc], params, use_tqdm=False)  # warm-up, not counted
    ACC.clear()
    order = list(names)
    batches = [prompts[i : i + conc] for i in range(conc, len(prompts), conc)]
    for batch in tqdm(batches, desc=f"batches of {conc}"):
        for name in order:
            t = time.perf_counter()
            engines[name].generate(batch, params, use_tqdm=False)
            charge(f"{config_of(name)}/generate (wall)", t)
        order.reverse()
    del spare
    steps = {c: ACC[f"{c}/runner.execute_model"][0] for c in configs}
    rows = report(configs, steps)
    print(
        ", ".join(f"{n}: {steps[n]} steps" for n in configs),
        f"({conc} requests at a time)",
    )
    parts, forwards = [], []
    for r in rows:
        (forwards if r["function"].startswith("forward at") else parts).append(r)
    print_table("us per step", parts, configs)
    forwards.sort(key=lambda r: r["function"])
    print_table("forward by tokens: us per call", forwards, configs, "us_per_call")
    gates = {}
    for name, llm in engines.items():
        gate = llm.collective_rpc(gate_summary)[0]
        if gate is not None:
            gates[name] = gate
            print(f"{name} draft gate per bucket:", json.dumps(gate))
        use = llm.collective_rpc(budget_use_summary)[0]
        if use is not None:
            print(f"{name} budget use:", json.dumps(use))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"configs": configs, "steps": steps, "rows": rows, "gate": gates}, f
            )


if __name__ == "__main__":
    main()
