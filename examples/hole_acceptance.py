"""What drafting with holes in the drafter's context costs in acceptance: a
request retired from drafting (`length.retire_when_skipping`) that drafts again
has no drafter K/V for the tokens it ran while retired, and the drafter attends
to those slots as they are.

Two engines (demo models, `length.mode: fixed`, 16 requests at a time, greedy):
`upkeep` keeps the drafter's context on skipped steps, `holes` does not
(`adaflash_debug_context_upkeep(False)`, as a retired request). Each batch
skips its first S steps (S = 1: the prompt only; S = 31: the prompt and 30
tokens) and drafts on every step after. Prints, per S and engine, the drafting
rounds, the drafts accepted per round, the acceptance by draft position, and
whether the outputs match (they must: lossless either way).

Run (about 6 minutes on one core):
    VLLM_CPU_KVCACHE_SPACE=1 taskset -c 0 python examples/hole_acceptance.py \
        --skips 1,31
"""

from __future__ import annotations

import argparse
import json

from compare_no_draft import _engine, demo_prompts, in_process_engines


def sampler_stats(worker) -> dict:
    return worker.model_runner.rejection_sampler.stats()


def delta(after: list[int], before: list[int]) -> list[int]:
    """Per-position counts since `before` (the histograms grow with the block)."""
    before = before + [0] * (len(after) - len(before))
    return [a - b for a, b in zip(after, before, strict=True)]


def upkeep_off(worker) -> None:
    worker.model_runner.drafter.context_upkeep = False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skips", default="1,31", help="comma list of S")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    in_process_engines(1)
    from vllm import SamplingParams

    conc = args.concurrency
    engines = {name: _engine("adaflash:fixed", conc) for name in ("upkeep", "holes")}
    engines["holes"].collective_rpc(upkeep_off)
    prompts = demo_prompts(engines["upkeep"].get_tokenizer())
    prompts = prompts[100 : 100 + args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for skip in (int(s) for s in args.skips.split(",")):
        outputs = {}
        for name, llm in engines.items():
            before = llm.collective_rpc(sampler_stats)[0]
            outs = []
            for i in range(0, len(prompts), conc):
                # skip the batch's first `skip` steps, then draft every step
                pattern = "s" * skip + "d" * 400
                llm.collective_rpc("adaflash_debug_draft_pattern", args=(pattern,))
                done = llm.generate(prompts[i : i + conc], params, use_tqdm=False)
                outs += [list(o.outputs[0].token_ids) for o in done]
            after = llm.collective_rpc(sampler_stats)[0]
            drafted = delta(after["drafted"], before["drafted"])
            accepted = delta(after["accepted"], before["accepted"])
            rounds = drafted[0]
            outputs[name] = outs
            row = {
                "skip": skip,
                "engine": name,
                "rounds": rounds,
                "accepted_per_round": round(sum(accepted) / max(rounds, 1), 3),
                "acceptance_by_position": [
                    round(a / max(d, 1), 3)
                    for a, d in zip(accepted, drafted, strict=True)
                ],
            }
            print(json.dumps(row), flush=True)
        same = outputs["upkeep"] == outputs["holes"]
        print(f"S = {skip}: outputs {'identical' if same else 'DIFFER'}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
