"""Prefix-cache hits with a DFlash drafter: plain vLLM, AdaFlash with vLLM's
default for EAGLE-family drafters (drop the last matched block), and AdaFlash's
default (keep it). Demo models, one in-process engine each, the 16 longest-first
prose and code prompts over 140 tokens, served three times (greedy, 96 tokens):
per pass, the cached prompt tokens, the drafts accepted and the wall time.

Run (about 3 minutes):
    taskset -c 0 python examples/prefix_cache.py
    taskset -c 0 python examples/prefix_cache.py --draft-every 2

`--draft-every 2`: the AdaFlash engines run the drafter on every other step only
(the steps between queue their context K/V, as skipped steps do).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"
CONFIGS = {
    "plain": None,
    "adaflash, vLLM's block drop": {"disable_eagle_block_drop": False},
    "adaflash (default)": {},
}


def _prompts(tok, n: int = 16, min_tokens: int = 141) -> list[str]:
    from adaflash_vllm.training.data import chat_prompts, load_prompts

    prompts = []
    for name in ("prompts_prose.jsonl", "prompts_code.jsonl"):
        records = load_prompts(DEMO / "data" / name)
        for text in chat_prompts(tok, [r["prompt"] for r in records]):
            if len(tok(text).input_ids) >= min_tokens:
                prompts.append(text)
    return prompts[:n]


def _engine(extra: dict | None):
    from adaflash_vllm.bench.paired import offline_engine

    spec = None
    if extra is not None:
        spec = {
            "method": "dflash",
            "model": str(DEMO / "drafter"),
            "num_speculative_tokens": 7,
            "adaflash": {"length": {"mode": "fixed"}},
            **extra,
        }
    return offline_engine(str(DEMO / "target"), spec, 16, log_stats=True)


def _counters(llm) -> dict[str, float]:
    names = ("num_accepted_tokens", "num_draft_tokens")
    return {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name in {f"vllm:spec_decode_{n}" for n in names}
    }


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-every", type=int, default=1)
    every = parser.parse_args().draft_every
    prompts = _prompts(AutoTokenizer.from_pretrained(str(DEMO / "target")))
    params = SamplingParams(temperature=0, max_tokens=96)
    outputs = {}
    for name, extra in CONFIGS.items():
        llm = _engine(extra)
        if extra is not None and every > 1:
            llm.collective_rpc("adaflash_debug_draft_every", args=(every,))
        for i in range(3):
            before, started = _counters(llm), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            after = _counters(llm)
            accepted, drafted = (
                after.get(f"vllm:spec_decode_{n}", 0)
                - before.get(f"vllm:spec_decode_{n}", 0)
                for n in ("num_accepted_tokens", "num_draft_tokens")
            )
            cached = sum(o.num_cached_tokens for o in outs)
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
            drafts = (
                f", accepted {accepted:.0f}/{drafted:.0f} drafts" if drafted else ""
            )
            print(
                f"{name:>28} pass {i}: cached {cached}/{prompt_tokens} prompt "
                f"tokens{drafts}, {seconds:.2f} s",
                flush=True,
            )
            outputs.setdefault(name, []).append([o.outputs[0].token_ids for o in outs])
        del llm
    reference = outputs["plain"][0]
    same = all(p == reference for passes in outputs.values() for p in passes)
    print("every pass token-identical to plain's first:", same)


if __name__ == "__main__":
    main()
