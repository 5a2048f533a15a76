"""Engines stepped in turn: plain vLLM against other configurations at a steady
load, with the machine's slow and fast spells shared step by step.

Paired rounds (`compare_no_draft.py`) alternate whole batches of 64 prompts, so a
slow spell of this VM lands on one engine's round and not the other's; their
ratios swing by 5-15% per round. Here every engine runs in this process
(in-process engine core, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) and they take single
steps in turn (a new seeded random order every step), each keeping `--concurrency`
requests in flight: a finished request is replaced by the next one of the same
seeded stream (prose prompts unless `--domain`, output lengths drawn from
[max_tokens / 3, 5 max_tokens / 3], greedy, ignore_eos). AdaFlash's clocks (its
draft gate's round rates and the online cost curve) leave out the time an engine
sat idle while the others stepped (the `adaflash_exclude_gap` RPC).

`--domain math` or `code` takes the requests from the demo's math or code
prompts instead of prose (domains the demo drafter was not trained on).

`--episode N --domain prose,code`: bursts of N requests, each from the next
domain in turn, each drained (the batch falls to one) before the next starts:
traffic that shifts domain between bursts, whose drains visit the small batch
sizes after the text changed. Adds each configuration's tok/s ratio per
episode, over whole episodes and over their drains, by domain (the engines
need not be at the same step: an episode is the same requests in every one).

Run (about 5 minutes on 2 cores for 1,500 steps of three engines at 32):
    taskset -c 0 python examples/compare_steps.py --concurrency 32 --steps 1500 \
        --configs no_draft,adaflash
    taskset -c 0 python examples/compare_steps.py --concurrency 1 --steps 3000 \
        --configs dflash,adaflash

Engines built later in the process step a little faster (0.4-1% per place in
A/A runs, BENCHMARKS.md run 25): `--twins` builds every configuration twice at
mirrored places and pools each pair, which cancels that. Without it the engines
are built in the order of `--configs`, plain last, after a spare AdaFlash engine
that is never stepped.

A `dflash` engine here runs vLLM's DFlash code through the runner as AdaFlash's
worker patches leave it (this process has them once an AdaFlash engine starts),
including AdaFlash's faster first-index argmax for the drafts (row_max.py): a
baseline at least as fast as stock.

`--configs` as in `compare_no_draft.py` (no_draft, dflash[:K], adaflash[:VARIANT]),
and `no_draft:noctx` / `no_draft:nobook`: never drafting with the drafter's
context K/V upkeep off / with the AdaFlash scheduler's per-round bookkeeping
off (measurements only: what each part of a skipped step costs).
Prints, per configuration, its tok/s over its own steps and the ratio to plain
(AdaFlash ones also to each `dflash[:K]` and `no_draft` that ran, AdaFlash
variants to `adaflash`) as the mean
over blocks of `--block` steps with a 95% interval; the median time of steps at
the full batch that ran no new prompt, and of those that did; at one request
also the ratio per request (the same request's time in each engine: engines that
emit different tokens per step are at different text at any moment, which the
per-block ratios mix in); then one JSON line. `--profile DIR` profiles each
engine's steps with its own cProfile (the same stretch of machine time for
each), for `examples/diff_profiles.py`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os

from compare_no_draft import _engine, demo_prompts, in_process_engines, parse_configs

# no_draft:VARIANT: the never-drafting engine with one part of a skipped step off
# (measurements only: what that part costs)
_NO_DRAFT_VARIANTS = {
    # skipped steps queue no context K/V for the drafter (adaflash_debug_context_
    # upkeep): the drafter's cache upkeep, priced
    "noctx",
    # the AdaFlash scheduler's per-round bookkeeping off (round counters, round
    # log, admission feedback): in-process only, on the engine's own scheduler
    "nobook",
}


# what the summary keeps of each batch-size bucket's block length
_BLOCK_KEYS = ("length", "trials", "switches", "undecided", "extended", "cap", "capped")


def _compared(name: str, base: str) -> bool:
    """Every configuration against plain; AdaFlash ones against every DFlash K
    and `no_draft` too, AdaFlash variants against `adaflash`, other DFlash Ks
    against `dflash` (K = 7) and no_draft variants against `no_draft`."""
    if name == base:
        return False
    if base == "adaflash":
        return name.startswith("adaflash:")
    if base == "plain" or name.startswith("adaflash"):
        return True
    if base == "no_draft":
        return name.startswith("no_draft:")
    return base == "dflash" and name.startswith("dflash:")


def _build(config: str, concurrency: int):
    name, _, variant = config.partition(":")
    if name != "no_draft":
        return _engine(config, concurrency)
    llm = _engine("no_draft", concurrency)
    if variant == "noctx":
        llm.collective_rpc("adaflash_debug_context_upkeep", args=(False,))
    elif variant == "nobook":
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        scheduler._decode_rounds_before = lambda scheduler_output: {}
        scheduler._record_rounds_without_drafts = lambda *_: []
    return llm


MAX_MODEL_LEN = 1024  # bench/paired.py `offline_engine`


def episode_prompts(sets: list[list[str]], episode: int) -> list[str]:
    """The stream's prompts, `episode` per episode from each set in turn (set
    e % len(sets) for episode e), each set's prompts in order; as long as a
    pass over the largest set takes (the stream cycles it)."""
    rounds = -(-max(len(s) for s in sets) // episode)
    return [
        s[(r * episode + j) % len(s)]
        for r in range(rounds)
        for s in sets
        for j in range(episode)
    ]


def _episode_report(summary, groups, pairs, domains, concurrency) -> None:
    """Per configuration pair, tok/s ratios per finished episode (the first
    left out), over whole episodes and over their drains (steps below the full
    batch), by the episode's domain."""
    from adaflash_vllm.bench.stepped import episode_ratios, ratio_summary

    for name, base in pairs:
        for part, below in (("episode", None), ("drain", concurrency)):
            ratios = episode_ratios(groups[name], groups[base], drain_below=below)
            for d, domain in enumerate(domains):
                r = ratio_summary(
                    [v for e, v in ratios.items() if e % len(domains) == d],
                    "episodes",
                )
                key = f"{part}_vs_{base}"
                summary.setdefault(key, {}).setdefault(name, {})[domain] = r
                print(
                    f"{name} / {base}, {domain} {part}s: tok/s "
                    f"{r['tok_s_ratio_mean']:.3f} +- {r['tok_s_ratio_ci95']:.3f} "
                    f"(95%, {r['episodes']} episodes; median "
                    f"{r['tok_s_ratio_median']:.3f})"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--steps", type=int, default=1500, help="per engine")
    p.add_argument("--warmup-steps", type=int, default=100, help="left out")
    p.add_argument("--block", type=int, default=50, help="steps per ratio sample")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--domain",
        default="prose",
        help="the demo prompt set the requests come from (prose, math, code); "
        "with --episode a comma list, one set per episode in turn",
    )
    p.add_argument(
        "--episode",
        type=int,
        default=0,
        metavar="N",
        help="N requests per episode: each episode drains (the batch falls to "
        "one) before the next starts, its prompts from the next --domain set; "
        "reports each configuration's tok/s ratio per episode and over the "
        "drains (0: one steady stream)",
    )
    p.add_argument("--configs", default="no_draft")
    p.add_argument("--out", help="also write the JSON summary here")
    p.add_argument(
        "--order",
        choices=("shuffle", "reverse"),
        default="shuffle",
        help="the engines' order within each step: a new seeded random one every "
        "step (default), or reversing every step (runs before 25)",
    )
    p.add_argument(
        "--twins",
        action="store_true",
        help="build every configuration twice, the twins in reverse order "
        "(A B plain plain#2 B#2 A#2), and pool each pair's steps and request "
        "times: cancels the build-order effect (twice the steps' time)",
    )
    p.add_argument(
        "--no-spare",
        dest="spare",
        action="store_false",
        help="build no spare engine first (by default one AdaFlash engine is built "
        "before the measured ones and never stepped, so that the measured engines "
        "can be built in the order of --configs)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile each engine's steps (timings then include its overhead) and "
        "write DIR/CONFIG.pstats, for examples/diff_profiles.py",
    )
    args = p.parse_args()
    try:
        configs = parse_configs(args.configs, _NO_DRAFT_VARIANTS)
    except ValueError as e:
        p.error(str(e))
    if args.steps <= args.warmup_steps + args.block:
        p.error("--steps must exceed --warmup-steps + --block")
    domains = args.domain.split(",")
    if set(domains) - {"prose", "math", "code"} or (
        len(domains) > 1 and not args.episode
    ):
        p.error("--domain: prose, math or code (a comma list only with --episode)")
    if args.episode < 0:
        p.error("--episode must be >= 0")
    # GiB per engine (1 with twins: up to 2 x 4 + 1 engines in 24 GiB)
    in_process_engines(1 if args.twins else 2)
    from tqdm import tqdm
    from vllm import SamplingParams

    from adaflash_vllm.bench.paired import staggered_lengths
    from adaflash_vllm.bench.stepped import (
        Stream,
        block_ratios,
        config_of,
        pooled_median_step_ms,
        pooled_tok_s,
        ratio_summary,
        request_ratios,
        step_in_turn,
        twin_build_order,
    )

    # Build order. Engines built later in this process run their steps a little
    # faster (A/A runs of three identical DFlash engines: 0.03-0.10 ms per
    # place at ~8 ms a step, whatever the stepping order; BENCHMARKS.md run
    # 25). `--twins` builds every configuration twice at mirrored places and
    # pools each pair; otherwise the order is `--configs` as given, plain last.
    # The spare AdaFlash engine built first applies AdaFlash's worker patches
    # (patches.py): vLLM's runner then builds every later DFlash drafter as an
    # AdaFlashProposer, which runs vLLM's own DFlash code without an AdaFlash
    # config (a stock DFlash engine built before the patches would fail the
    # runner's isinstance check once they are in). Without the spare, AdaFlash
    # engines come first.
    spare = _build("adaflash", args.concurrency) if args.spare else None
    first = [c for c in configs if c != "plain"] + ["plain"]
    if spare is None:
        first.sort(key=lambda c: not c.startswith(("adaflash", "no_draft")))
    if args.twins:
        first = twin_build_order(first)
    built = {c: _build(config_of(c), args.concurrency) for c in first}
    tokenizer = built["plain"].get_tokenizer()
    # prompts that leave room for the longest answer (a code prompt or two do
    # not: reached, they stopped the run)
    room = MAX_MODEL_LEN - 5 * args.max_tokens // 3
    sets = [
        [p for p in demo_prompts(tokenizer, d) if len(tokenizer(p).input_ids) <= room]
        for d in domains
    ]
    prompts = episode_prompts(sets, args.episode) if args.episode else sets[0]
    warm = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in built.values():
        llm.generate(prompts[:8], warm, use_tqdm=False)
    lengths = staggered_lengths(len(prompts), args.max_tokens)
    streams = {
        c: Stream(
            c,
            llm,
            args.concurrency,
            prompts,
            lengths,
            adaflash=c.startswith(("adaflash", "no_draft")),
            profile=cProfile.Profile() if args.profile else None,
            episode=args.episode,
        )
        for c, llm in built.items()
    }
    step_in_turn(
        list(streams.values()),
        args.steps,
        progress=lambda r: tqdm(r, desc="steps", unit="step", mininterval=10),
        order=args.order,
    )
    del spare  # kept built (never stepped) until the measured steps are done
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        for name, s in streams.items():
            s.profile.dump_stats(os.path.join(args.profile, f"{name}.pstats"))
    # each configuration's engine, or its twins
    groups = {c: [s for n, s in streams.items() if config_of(n) == c] for c in configs}

    skip = args.warmup_steps
    summary: dict = {
        "concurrency": args.concurrency,
        "steps": args.steps,
        "domain": args.domain,
        "episode": args.episode,
        "order": args.order,
        "built": (["spare adaflash"] if args.spare else []) + first,
    }
    nan = float("nan")
    for name, twins in groups.items():
        steps = [x for s in twins for x in s.steps[skip:]]
        e = summary.setdefault("engines", {})[name] = {
            "tok_s": pooled_tok_s(twins, skip),
            "tokens_per_step": sum(x.tokens for x in steps) / len(steps),
            "median_step_ms_decode": pooled_median_step_ms(twins, skip, False),
            "median_step_ms_new_prompt": pooled_median_step_ms(twins, skip, True),
            "new_prompt_steps": sum(x.new_prompt for x in steps),
        }
        print(
            f"{name:>22}: {e['tok_s']:8.1f} tok/s, {e['tokens_per_step']:.2f} "
            f"tokens/step; median step at {args.concurrency} requests "
            f"{e['median_step_ms_decode'] or nan:.2f} ms without a new prompt, "
            f"{e['median_step_ms_new_prompt'] or nan:.2f} ms with one"
        )
    bases = ["plain"] + [
        b for b in configs if b.startswith("dflash") or b in ("no_draft", "adaflash")
    ]
    pairs = [(n, b) for b in bases for n in configs if _compared(n, b)]
    for name, base in pairs if not args.episode else ():
        # (with episodes the engines are at different episodes at a step:
        # `_episode_report` compares them episode by episode instead)
        r = ratio_summary(
            block_ratios(groups[name], groups[base], skip, args.block), "blocks"
        )
        summary.setdefault(f"vs_{base}", {})[name] = r
        print(
            f"{name} / {base}: tok/s {r['tok_s_ratio_mean']:.3f} +- "
            f"{r['tok_s_ratio_ci95']:.3f} (95%, {r['blocks']} blocks of "
            f"{args.block} steps; median {r['tok_s_ratio_median']:.3f})"
        )
    if args.episode:
        _episode_report(summary, groups, pairs, domains, args.concurrency)
    if args.concurrency == 1:
        # The same request in each engine (the same prompt and tokens, greedy):
        # engines that emit different tokens per step are at different requests
        # at any moment, so per-block ratios mix in how easy each one's text is.
        for name, base in pairs:
            r = ratio_summary(request_ratios(groups[name], groups[base]), "requests")
            summary.setdefault(f"per_request_vs_{base}", {})[name] = r
            print(
                f"{name} / {base}, per request: tok/s {r['tok_s_ratio_mean']:.3f} "
                f"+- {r['tok_s_ratio_ci95']:.3f} (95%, {r['requests']} requests; "
                f"median {r['tok_s_ratio_median']:.3f})"
            )
    for name, llm in built.items():
        if name.startswith("adaflash"):
            state = llm.collective_rpc("adaflash_budget_state")[0]
            gate = state["draft_gate"] or {}
            buckets = {
                b: {
                    k: g.get(k)
                    for k in (
                        "drafted_steps",
                        "skipped_steps",
                        "drafting",
                        "switches",
                        "explorations",
                        "predicted_checks",
                        "predicted_switches",
                        "passed_checks",
                        "check_value",
                        "checks_closed",
                    )
                }
                for b, g in (gate.get("buckets") or {}).items()
            }
            block = state.get("block_length") or {}
            summary.setdefault("adaflash_state", {})[name] = {
                "drafted_steps": gate.get("drafted_steps"),
                "skipped_steps": gate.get("skipped_steps"),
                # revisited buckets that acted on a shift of first-position
                # acceptance, and that acceptance at the end
                "shifts": gate.get("shifts"),
                "first_accept": gate.get("first_accept"),
                "buckets": buckets,
                # per batch-size bucket: L*, trials, switches, full blocks run
                # after a fully accepted round, the budgets' cap and the steps
                # it shortened
                "block_length": {
                    b: {k: g.get(k) for k in _BLOCK_KEYS}
                    for b, g in (block.get("buckets") or {}).items()
                },
                "budget_use": state.get("budget_use"),
                "retired": state.get("retired"),  # retire_when_skipping's counts
                "steady_skip": state.get("steady_skip"),  # entries, short steps
                # rounds by drafts verified (index j: j drafts), every step
                "verify_hist": llm.collective_rpc("adaflash_sampler_stats")[0].get(
                    "verify_hist"
                ),
            }
            steps = {
                k: v
                for k, v in summary["adaflash_state"][name].items()
                if k not in ("buckets", "block_length")
            }
            print(f"{name}: {steps}")
            for bucket, g in buckets.items():
                print(
                    f"  {name} bucket {bucket}: drafted {g['drafted_steps']}, "
                    f"skipped {g['skipped_steps']}, drafting {g['drafting']}, "
                    f"switches {g['switches']}, explorations {g['explorations']}, "
                    f"predicted checks {g['predicted_checks']} (switches "
                    f"{g['predicted_switches']}), passed {g['passed_checks']}, "
                    f"check value {_fmt(g['check_value'])} over "
                    f"{g['checks_closed']} checks"
                )
            for bucket, g in summary["adaflash_state"][name]["block_length"].items():
                print(f"  {name} bucket {bucket} block length: {g}")
    line = json.dumps(summary)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
