"""What does a spec-decode step cost when it drafts nothing? Plain vLLM vs AdaFlash
with a gate that never drafts (every step only writes the drafter's context K/V and
verifies 0 drafts), offline on the demo models, in one process, alternating.

Run (about 3 minutes on 2 cores):
    taskset -c 0 python examples/compare_no_draft.py --concurrency 32 --rounds 2

Prints tok/s per engine and round, and the no-draft / plain ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def _engine(no_draft: bool, concurrency: int):
    from vllm import LLM

    kwargs = {}
    if no_draft:
        kwargs = {
            "speculative_config": {
                "method": "dflash",
                "model": str(DEMO / "drafter"),
                "num_speculative_tokens": 7,
                "adaflash": {"length": {"mode": "fixed"}},
            },
            "worker_extension_cls": "adaflash_vllm.worker.AdaFlashWorkerExtension",
        }
    llm = LLM(
        str(DEMO / "target"),
        max_num_seqs=concurrency,
        enforce_eager=True,
        max_model_len=1024,
        dtype="float32",
        **kwargs,
    )
    if no_draft:
        llm.collective_rpc("adaflash_debug_draft_every", args=(10**9,))
    return llm


def _tok_s(llm, prompts: list[str]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine (two here)
    raw = [
        json.loads(line)["prompt"]
        for line in (DEMO / "data" / "prompts_prose.jsonl").read_text().splitlines()
    ][: args.num_prompts]
    engines = {
        "plain": _engine(False, args.concurrency),
        "no_draft": _engine(True, args.concurrency),
    }
    tok = engines["plain"].get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r}], tokenize=False, add_generation_prompt=True
        )
        for r in raw
    ]
    for llm in engines.values():  # warm-up
        _tok_s(llm, prompts[:8])
    results: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.rounds):
        for name, llm in engines.items():
            results[name].append(_tok_s(llm, prompts))
            print(f"round {i + 1} {name:9s} {results[name][-1]:8.1f} tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"no_draft / plain (medians): {med['no_draft'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
