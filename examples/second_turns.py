"""A prompt set of follow-up turns: each conversation's first prompt, the demo
target's own answer to it (greedy) and one more user turn ("Go on." by
default), as JSONL records with `history` (training/data.py). The records go
wherever a prompt file does: `adaflash bench shift --phases FILE:N` (an online
stream of second turns), `adaflash eval-drafter --prompts FILE` and
`adaflash train-drafter --prompts FILE` (the target answers the second turn).

BENCHMARKS.md run 36 builds two: the online stream from the prose prompts the
target was trained on, and a held-out set from the demo's prose prompts.
Run (about a minute on one core for 640 prompts):
    VLLM_CPU_KVCACHE_SPACE=1 taskset -c 0 python examples/second_turns.py \
        --prompts examples/demo/data/train_target.jsonl --domain prose \
        --num-prompts 640 --out runs/second-turns/train-prose.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare_no_draft import _engine, in_process_engines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True, help="a JSONL prompt file")
    p.add_argument("--domain", help="only the records of this domain")
    p.add_argument("--skip-prompts", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96, help="first answers' length")
    p.add_argument("--follow-up", default="Go on.", help="the second user turn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    in_process_engines(1)
    from adaflash_vllm.training.data import chat_prompts, load_prompts
    from vllm import SamplingParams

    records = load_prompts(args.prompts)
    if args.domain:
        records = [r for r in records if r.get("domain") == args.domain]
    first = args.skip_prompts
    records = records[first : first + args.num_prompts]
    if not records:
        raise SystemExit(f"no prompts left in {args.prompts} after the filters")
    llm = _engine("plain", 64)
    texts = chat_prompts(llm.get_tokenizer(), records)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outs = llm.generate(texts, params, use_tqdm=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i, (rec, res) in enumerate(zip(records, outs, strict=True)):
            turns = [
                *rec.get("history", []),
                {"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": res.outputs[0].text},
            ]
            row = {
                "id": f"{rec.get('id', first + i)}-turn2",
                "domain": rec.get("domain", ""),
                "history": turns,
                "prompt": args.follow_up,
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(records)} second turns -> {out}")


if __name__ == "__main__":
    main()
