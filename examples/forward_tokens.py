"""What the target's forward computes per call, plain vLLM vs AdaFlash without
drafts (demo models, one in-process engine each, 16 requests of the prose set):
the token count and median time of each forward shape. The same prompts are
served twice, so the second pass's prefill shows the prefix-cache hits.

Run (about 2 minutes):
    taskset -c 0 python examples/forward_tokens.py
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def _engine(config: str, concurrency: int):
    from adaflash_vllm.bench.paired import offline_engine

    spec = None
    if config != "plain":
        spec = {
            "method": "dflash",
            "model": str(DEMO / "drafter"),
            "num_speculative_tokens": 7,
            "adaflash": {"length": {"mode": "fixed"}},
        }
    llm = offline_engine(str(DEMO / "target"), spec, concurrency)
    if config != "plain":  # never draft: every step is a step without a draft
        llm.collective_rpc("adaflash_debug_draft_every", args=(10**9,))
    return llm


def _time_forwards(llm, calls: list) -> None:
    """Hook the target model: append (tokens, seconds) per forward to `calls`."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    started = []

    def pre(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        started.append((None if ids is None else ids.shape[0], time.perf_counter()))

    def post(_module, _args, _kwargs, _out):
        tokens, t0 = started.pop()
        calls.append((tokens, time.perf_counter() - t0))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # hooks in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from adaflash_vllm.training.data import chat_prompts, load_prompts
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    records = load_prompts(DEMO / "data" / "prompts_prose.jsonl", limit=16)
    prompts = chat_prompts(tok, [r["prompt"] for r in records])
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for config in ("plain", "no_draft"):
        llm = _engine(config, len(prompts))
        llm.generate(prompts, params, use_tqdm=False)  # fills the prefix cache
        calls: list = []
        _time_forwards(llm, calls)
        llm.generate(prompts, params, use_tqdm=False)
        by_tokens = collections.defaultdict(list)
        for tokens, seconds in calls:
            by_tokens[tokens].append(seconds)
        for tokens, times in sorted(by_tokens.items(), key=lambda kv: -len(kv[1])):
            print(
                f"{config:>8}: {len(times):3d} forwards of {tokens} tokens, "
                f"median {1e3 * statistics.median(times):.2f} ms"
            )
        del llm


if __name__ == "__main__":
    main()
