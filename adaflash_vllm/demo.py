"""`adaflash demo`: the main job. Serves a prompt stream that starts in the drafter's
domain (prose/chat) and shifts to math, then code, with plain vLLM, stock vLLM
DFlash and AdaFlash on the bundled demo models, and reports tok/s, speedup and
tau per phase (table + PNG). Everything runs on the CPU build of vLLM.

Run: bash scripts/bootstrap.sh demo   (or `adaflash demo --help` for sizes)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from adaflash_vllm.bench.configs import BenchSetup, check_paths
from adaflash_vllm.bench.harness import MAX_MODEL_LEN, run_benchmark
from adaflash_vllm.bench.workloads import (
    Workload,
    check_output_len_spread,
    load_phase,
    longest_output,
)

DEMO_DIR = Path(__file__).resolve().parents[1] / "examples" / "demo"
SIZES = {  # per_phase, window, max_tokens
    "small": (8, 4, 48),
    "default": (24, 8, 96),
    "large": (64, 8, 128),
}


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="default",
        help="small (used by the tests): ~2 min on 2 cores; default: ~3 min; "
        "large: ~4.5 min (BENCHMARKS run 40). Sizes are (requests per phase, "
        "window = requests in flight, mean max tokens): "
        + ", ".join(f"{k}={v}" for k, v in SIZES.items()),
    )
    p.add_argument(
        "--phases",
        default="prose,math,code",
        help="prompt sets in order (bundled: prose, math, code; or JSONL)",
    )
    p.add_argument(
        "--configs",
        default="plain,dflash,adaflash,plain",
        help="configurations to compare (see `adaflash bench --help`); one "
        "named again runs again (plain before and after the others: the ratios "
        "are against their mean, and the two plain runs show the drift)",
    )
    p.add_argument(
        "--closed-windows",
        action="store_true",
        help="serve each window of requests as one closed batch (the demo "
        "up to run 39); default: the stream queued whole, a "
        "finished request replaced at once, as `vllm serve` does for WINDOW "
        "clients",
    )
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.5,
        help="each answer's length drawn (seeded, the same for every "
        "configuration) from max tokens * [1 - S, 1 + S], as answers that end "
        "at EOS vary; 0: every answer max tokens long (the demo up to run 39), "
        "so plain decoding runs each window in lockstep",
    )
    p.add_argument("--target", default=str(DEMO_DIR / "target"))
    p.add_argument("--drafter", default=str(DEMO_DIR / "drafter"))
    p.add_argument(
        "--adaflash-config",
        default=str(DEMO_DIR / "adaflash-demo.json"),
        help="AdaFlash config (its online folders are redirected into "
        "OUT/online, emptied at the start, so each run starts fresh)",
    )
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    p.add_argument(
        "--cores",
        default="0" if (os.cpu_count() or 1) > 1 else None,
        help="pin every engine to these cores (default 0: the online "
        "trainer gets the others)",
    )
    p.add_argument("--out", default="runs/demo")


def run_demo(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    per_phase, window, max_tokens = SIZES[args.size]
    check_output_len_spread(args.output_len_spread)
    setup = BenchSetup(
        target=args.target,
        drafter=args.drafter,
        num_speculative_tokens=args.num_speculative_tokens,
        adaflash_config=args.adaflash_config,
    )
    check_paths(setup)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    phases = [
        load_phase(
            n,
            tokenizer,
            count=per_phase,
            max_prompt_tokens=MAX_MODEL_LEN
            - longest_output(max_tokens, args.output_len_spread),
        )
        for n in args.phases.split(",")
        if n
    ]
    workload = Workload(
        "shift",
        phases,
        window=window,
        max_tokens=max_tokens,
        refill=not args.closed_windows,
        output_len_spread=args.output_len_spread,
    )
    configs = [c for c in args.configs.split(",") if c]
    print(
        f"AdaFlash demo: {len(phases)} phases x {per_phase} requests "
        f"({', '.join(p.name for p in phases)}), window {window}, "
        f"{max_tokens} tokens each"
        + (f" (+-{args.output_len_spread:.0%})" if args.output_len_spread else "")
        + ", "
        f"{'closed windows' if args.closed_windows else 'refilled'}; "
        f"configs: {', '.join(configs)}",
        flush=True,
    )
    t0 = time.perf_counter()
    summary = run_benchmark(
        setup=setup,
        config_names=configs,
        workload=workload,
        out_dir=args.out,
        driver="offline",
        cores=args.cores,
        command="adaflash demo " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        title="AdaFlash demo: prose -> math -> code",
    )
    print(
        f"\nplot: {summary['plots'][0]}\nreport: {summary['report']}\n"
        f"wall: {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    for name, swaps in summary["swaps"].items():
        print(
            f"{name}: drafter v{swaps['final_version']} after {swaps['swaps']} "
            "online swap(s)",
            flush=True,
        )
    print(json.dumps(summary["summary"]))
    return summary
