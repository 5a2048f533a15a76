"""One AdaFlash engine whose steps alternate a setting in blocks, plain vLLM
stepped in turn: what the setting changes in a step, with the engine's build
place, its gate's path and its requests the same for both settings.

`compare_steps.py` compares separate engines: their twins sit at different
places in memory (a step's time moves 0.4-1% with it) and their draft gates
take their own paths (one twin drafts 80 steps where another drafts 20), which
at 16-64 requests swamp a change of a few tenths of a millisecond per step.
Here the setting flips every `--block` steps on one engine (after
`--warmup-steps`), through a debug RPC:

- `plain_steps`: the steady skipping state's steps run as plain decoding
  steps (patches.py W10) or through the runner's spec-decode path
  (`adaflash_debug_steady_plain`).

Each step of the AdaFlash engine is paired with the plain engine's step taken
next to it (the two step in a seeded random order). Reported per setting, over
the steps of the steady skipping state at the full batch that ran no new
prompt in either engine: the median of AdaFlash's step time over plain's
(step by step), and the ratio of the two settings' medians of that, with a 95%
interval from the blocks (the per-block medians of one setting against the
mean of its neighbouring blocks of the other). Then AdaFlash's time by kind
of step (the steady state's or another, with or without a new prompt) against
plain's whole time and its time in steps with a new prompt (both settings,
after the warm-up; the engines ran the same requests, not always in the same
steps): where the rest of the gap to plain goes.

Run (about 3 minutes on 2 cores for 3,000 steps at 16 requests):
    VLLM_CPU_KVCACHE_SPACE=1 taskset -c 0 python examples/toggle_in_blocks.py \
        --concurrency 16 --steps 3000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from compare_no_draft import _engine, demo_prompts, in_process_engines
from compare_steps import MAX_MODEL_LEN

SETTINGS = {"plain_steps": "adaflash_debug_steady_plain"}


def _block_ratio(per_block: dict[int, list[float]], on: bool) -> list[float]:
    """Each block of setting `on` (odd blocks are on): its median step ratio
    over the mean of its neighbouring blocks' (the other setting)."""
    out = []
    for b, values in per_block.items():
        if (b % 2 == 1) != on or not values:
            continue
        around = [
            statistics.median(per_block[n]) for n in (b - 1, b + 1) if per_block.get(n)
        ]
        if around:
            out.append(statistics.median(values) / statistics.mean(around))
    return out


def _time_by_kind(streams: dict, steady: list[bool], skip: int) -> dict:
    """After `skip` steps (both settings): AdaFlash's time by kind of step (the
    steady state's or another, with or without a new prompt) and plain's, in
    all and in its steps with a new prompt."""
    kinds: dict[str, dict] = {}
    for i, a in enumerate(streams["ada"].steps[skip:], start=skip):
        kind = "steady" if steady[i] else "other"
        kind += ", new prompt" if a.new_prompt else ""
        k = kinds.setdefault(kind, {"steps": 0, "seconds": 0.0})
        k["steps"] += 1
        k["seconds"] += a.seconds
    plain = streams["plain"].steps[skip:]
    prompt = [q for q in plain if q.new_prompt]
    return {
        "adaflash": dict(sorted(kinds.items())),
        "plain_seconds": sum(q.seconds for q in plain),
        "plain_prompt_seconds": sum(q.seconds for q in prompt),
        "plain_prompt_steps": len(prompt),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--block", type=int, default=25)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--domain", default="prose", choices=("prose", "math", "code"))
    p.add_argument("--setting", default="plain_steps", choices=sorted(SETTINGS))
    p.add_argument("--out", help="write the summary JSON here too")
    args = p.parse_args()
    in_process_engines(1)
    from tqdm import tqdm
    from vllm import SamplingParams

    from adaflash_vllm.bench.paired import mean_ci, staggered_lengths
    from adaflash_vllm.bench.stepped import Stream

    plain = _engine("plain", args.concurrency)
    ada = _engine("adaflash", args.concurrency)
    tokenizer = plain.get_tokenizer()
    room = MAX_MODEL_LEN - 5 * args.max_tokens // 3
    prompts = [
        q
        for q in demo_prompts(tokenizer, args.domain)
        if len(tokenizer(q).input_ids) <= room
    ]
    warm = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in (plain, ada):
        llm.generate(prompts[:8], warm, use_tqdm=False)
    lengths = staggered_lengths(len(prompts), args.max_tokens)
    drafter = ada.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    streams = {
        "plain": Stream("plain", plain, args.concurrency, prompts, lengths),
        "ada": Stream(
            "adaflash", ada, args.concurrency, prompts, lengths, adaflash=True
        ),
    }
    rpc = SETTINGS[args.setting]
    rng = random.Random(0)
    for s in streams.values():
        s.fill()
    on_steps, steady = [], []
    for i in tqdm(range(args.steps), desc="steps", unit="step", mininterval=10):
        on = i >= args.warmup_steps and ((i - args.warmup_steps) // args.block) % 2
        ada.collective_rpc(rpc, args=(bool(on),))
        before = drafter.steady_steps
        for s in rng.sample(list(streams.values()), 2):
            s.step()
        on_steps.append(bool(on))
        steady.append(drafter.steady_steps > before)
    ada.collective_rpc(rpc, args=(True,))

    # steady steps at the full batch that ran no new prompt in either engine
    per_block: dict[int, list[float]] = {}
    ratios: dict[bool, list[float]] = {False: [], True: []}
    pairs = zip(streams["ada"].steps, streams["plain"].steps, strict=True)
    for i, (a, q) in enumerate(pairs):
        if i < args.warmup_steps or not steady[i]:
            continue
        full = a.batch == q.batch == args.concurrency
        if not full or a.new_prompt or q.new_prompt:
            continue
        r = a.seconds / q.seconds
        ratios[on_steps[i]].append(r)
        per_block.setdefault((i - args.warmup_steps) // args.block, []).append(r)
    summary = {
        "concurrency": args.concurrency,
        "steps": args.steps,
        "domain": args.domain,
        "setting": args.setting,
        "steps_per_setting": {str(k): len(v) for k, v in ratios.items()},
        "median_step_over_plain": {
            str(k): statistics.median(v) for k, v in ratios.items() if v
        },
        "time": _time_by_kind(streams, steady, args.warmup_steps),
    }
    on_over_off = _block_ratio(per_block, on=True)
    if len(on_over_off) >= 2:
        mean, ci = mean_ci(on_over_off)
        summary["on_over_off"] = {"blocks": len(on_over_off), "mean": mean, "ci95": ci}
    for k in (False, True):
        m = summary["median_step_over_plain"].get(str(k))
        print(
            f"{args.setting} {'on ' if k else 'off'}: median step / plain's "
            f"{m:.4f} over {len(ratios[k])} steady steps"
            if m is not None
            else f"{args.setting} {k}: no steady steps"
        )
    if "on_over_off" in summary:
        o = summary["on_over_off"]
        print(
            f"on / off (blocks of {args.block} steps): {o['mean']:.4f} +- "
            f"{o['ci95']:.4f} (95%, {o['blocks']} blocks)"
        )
    time = summary["time"]
    for kind, t in time["adaflash"].items():
        print(
            f"AdaFlash, {kind:>24}: {t['steps']:5d} steps, {t['seconds']:7.3f} s "
            f"({t['seconds'] / time['plain_seconds']:.1%} of plain's time)"
        )
    print(
        f"plain: {time['plain_seconds']:.3f} s, of it "
        f"{time['plain_prompt_seconds']:.3f} s in {time['plain_prompt_steps']} "
        "steps with a new prompt"
    )
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
