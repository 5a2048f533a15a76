"""`adaflash bench`: run configurations side by side on one workload.

Examples:
    adaflash bench sweep --configs plain,dflash,adaflash --concurrency 1,4,16,32,64
    adaflash bench shift --configs plain,dflash,adaflash --phases prose,math,code

The table goes to stdout, then one JSON object (the summary) as the last line;
OUT/ gets one JSON result per configuration, report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from adaflash_vllm.bench.configs import BenchSetup, check_paths
from adaflash_vllm.bench.harness import MAX_MODEL_LEN, rebuild_report, run_benchmark
from adaflash_vllm.bench.workloads import (
    Workload,
    check_output_len_spread,
    load_phase,
    longest_output,
    parse_phase,
)
from adaflash_vllm.errors import AdaFlashConfigError

DEMO_DIR = Path(__file__).resolve().parents[2] / "examples" / "demo"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "workload",
        choices=["sweep", "shift", "report"],
        help="sweep: throughput vs concurrency; shift: phases of prompt "
        "sets in order; report: re-plot OUT from its JSON files",
    )
    p.add_argument("--target", default=str(DEMO_DIR / "target"))
    p.add_argument("--drafter", default=str(DEMO_DIR / "drafter"))
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    p.add_argument("--adaflash-config", help="adaflash.json for `adaflash*` configs")
    p.add_argument(
        "--configs",
        default="plain,dflash,adaflash",
        help="comma list: plain, dflash, dflash_schedule, ngram, adaflash, "
        "adaflash:MODE",
    )
    p.add_argument(
        "--prompts", default="prose", help="sweep prompt set (name or JSONL)"
    )
    p.add_argument(
        "--phases",
        default="prose,math,code",
        help="shift: phases in order, each SET[+SET...][:COUNT]",
    )
    p.add_argument(
        "--per-phase", type=int, default=32, help="shift: requests per phase"
    )
    p.add_argument(
        "--window",
        type=int,
        default=8,
        help="shift: requests per window (= engine concurrency)",
    )
    p.add_argument(
        "--refill",
        action="store_true",
        help="shift, offline driver: queue the whole stream and keep WINDOW "
        "requests in flight, a finished one replaced at once (as served "
        "traffic); default: each window one closed batch",
    )
    p.add_argument("--concurrency", default="1,4,16,32,64", help="sweep levels")
    p.add_argument("--num-prompts", type=int, default=64, help="sweep prompt pool")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="sweep: requests per concurrency slot at each level (default 2 "
        "served, at least 8 requests; 4 offline); more amortise each pass's drain",
    )
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="sweep and shift: draw each request's output length (seeded, "
        "the same for every configuration) from max-tokens * [1 - S, 1 + S]; "
        "0 = all max-tokens",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="sweep repeats (median)")
    p.add_argument(
        "--driver",
        choices=["offline", "serve"],
        default=None,
        help="offline LLM (a sweep keeps C requests in flight at level C, as C "
        "clients would) or `vllm serve` + HTTP client (default: serve for sweep, "
        "offline for shift)",
    )
    p.add_argument("--cores", default=None, help="CPU cores for every engine, e.g. 0")
    p.add_argument("--out", default="runs/bench", help="output folder")
    p.add_argument("--title", default="")


def build_workload(args: argparse.Namespace, tokenizer) -> Workload:
    if args.requests_per_slot is not None and args.requests_per_slot < 1:
        raise AdaFlashConfigError(
            f"--requests-per-slot must be >= 1, got {args.requests_per_slot}"
        )
    check_output_len_spread(args.output_len_spread)  # before any engine starts
    if args.refill and (args.workload != "shift" or args.driver == "serve"):
        raise AdaFlashConfigError(
            "--refill is for `bench shift` with the offline driver (a served "
            "sweep's clients already keep each level's requests in flight)"
        )
    # prompts the engines can take whole, with the longest answer
    fit = MAX_MODEL_LEN - longest_output(args.max_tokens, args.output_len_spread)
    if args.workload == "shift":
        specs = [parse_phase(n, args.per_phase) for n in args.phases.split(",") if n]
        phases = [
            load_phase(n, tokenizer, count=count, max_prompt_tokens=fit)
            for n, count in specs
        ]
        return Workload(
            "shift",
            phases,
            window=args.window,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            refill=args.refill,
            output_len_spread=args.output_len_spread,
        )
    levels = tuple(int(c) for c in args.concurrency.split(",") if c)
    return Workload(
        "sweep",
        [
            load_phase(
                args.prompts, tokenizer, count=args.num_prompts, max_prompt_tokens=fit
            )
        ],
        concurrencies=levels,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        requests_per_slot=args.requests_per_slot,
        output_len_spread=args.output_len_spread,
    )


def run_bench(args: argparse.Namespace) -> dict:
    if args.workload == "report":
        summary = rebuild_report(args.out, args.title)
        print(json.dumps(summary))
        return summary
    setup = BenchSetup(
        target=args.target,
        drafter=args.drafter,
        num_speculative_tokens=args.num_speculative_tokens,
        adaflash_config=args.adaflash_config,
    )
    check_paths(setup)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    workload = build_workload(args, tokenizer)
    driver = args.driver or ("serve" if args.workload == "sweep" else "offline")
    command = "adaflash bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    summary = run_benchmark(
        setup=setup,
        config_names=[c for c in args.configs.split(",") if c],
        workload=workload,
        out_dir=args.out,
        driver=driver,
        repeats=args.repeats if args.workload == "sweep" else 1,
        cores=args.cores,
        command=command,
        title=args.title,
    )
    print(json.dumps(summary))
    return summary
