"""A load drop: each round is a burst of `--concurrency` prompts of which two ask
for `--tail` tokens and the rest for 96, so that after the burst the two long
requests run alone, where drafting pays again. With
`length.retire_when_skipping` the burst retires them (no drafter context, no
drafts); this shows what they do in the tail.

Engines (in this process, demo models, greedy; whole rounds in turn, the order
reversed each round):
- `adaflash`: the demo's cost_aware configuration (no retiring);
- `retire`: the same with `retire_when_skipping` (retired requests draft again
  where their batch size's gate drafts or a check of drafting is due);
- `retire_never_back`: retiring as before run 34, retired requests never draft
  again (`RetiredContext.unretire` disabled on that engine).

Per round and engine it prints one JSON line (wall seconds, drafts verified and
accepted in the round, the retired-request counters, a hash of the outputs,
which must match across engines), then each engine's total wall time and its
ratio to `adaflash`'s.

Run (about 5 minutes on one core):
    VLLM_CPU_KVCACHE_SPACE=2 taskset -c 0 python examples/load_drop.py \
        --rounds 4 --tail 600
"""

from __future__ import annotations

import argparse
import json
import time

from compare_no_draft import _engine, demo_prompts, in_process_engines

ENGINES = {
    "adaflash": "adaflash",
    "retire": "adaflash:retire",
    "retire_never_back": "adaflash:retire",
}


def counts(worker) -> dict:
    """Drafts verified and accepted so far, and the retired-request counters."""
    drafter = worker.model_runner.drafter
    stats = worker.model_runner.rejection_sampler.stats()
    retired = drafter.retired
    return {
        "drafted": sum(stats["drafted"]),
        "accepted": sum(stats["accepted"]),
        "retired": None if retired is None else retired.to_dict(),
    }


def never_back(worker) -> None:
    """Retired requests never draft again (retiring as before run 34)."""
    from adaflash_vllm.proposers.retired_context import RetiredContext

    drafter = worker.model_runner.drafter
    drafter.retired = RetiredContext(drafter.block_size)
    drafter.retired.unretire = lambda req_ids: 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tail", type=int, default=600, help="the long requests' tokens")
    args = p.parse_args()
    in_process_engines(2)
    from vllm import SamplingParams

    engines = {
        name: _engine(config, args.concurrency) for name, config in ENGINES.items()
    }
    engines["retire_never_back"].collective_rpc(never_back)
    prompts = demo_prompts(engines["adaflash"].get_tokenizer())
    short = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=args.tail, ignore_eos=True)
    params = [long, long] + [short] * (args.concurrency - 2)
    walls = dict.fromkeys(engines, 0.0)
    order = list(engines)
    for r in range(args.rounds):
        start = (r * args.concurrency) % max(1, len(prompts) - args.concurrency)
        batch = prompts[start : start + args.concurrency]
        hashes = set()
        for name in order:
            llm = engines[name]
            before = llm.collective_rpc(counts)[0]
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - t
            after = llm.collective_rpc(counts)[0]
            walls[name] += wall
            tokens = tuple(tuple(o.outputs[0].token_ids) for o in outs)
            hashes.add(hash(tokens))
            row = {
                "round": r,
                "engine": name,
                "wall_s": round(wall, 2),
                "drafted": after["drafted"] - before["drafted"],
                "accepted": after["accepted"] - before["accepted"],
                "retired": after["retired"],
            }
            print(json.dumps(row), flush=True)
        if len(hashes) != 1:
            raise SystemExit(f"round {r}: the engines' outputs differ")
        order.reverse()
    base = walls["adaflash"]
    for name, wall in walls.items():
        print(f"{name}: {wall:.1f} s in all, {base / wall:.3f}x adaflash's speed")


if __name__ == "__main__":
    main()
