"""What does trajectory logging cost? AdaFlash with online distillation's logging
on (every finished request written to the buffer; no trainer, so nothing else of
the online path runs) vs the same AdaFlash configuration without it, on the demo
models, offline, both engines in one process, measured in alternating rounds so
that a slow spell of the machine hits both alike.

Run (about 8 minutes on 2 cores):
    taskset -c 0 python examples/compare_logging.py --rounds 40

Per round it prints both engines' tok/s and engine-core CPU ms per output token,
then the logging / plain-AdaFlash ratio of the means with a 95% interval over the
per-round ratios (the rounds are paired), the records the buffer received, and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"


def _spec(buffer_root: Path | None) -> dict:
    adaflash: dict = {"length": {"mode": "cost_aware"}}
    if buffer_root is not None:
        adaflash["online"] = {
            "enabled": True,
            "push": False,
            "buffer_dir": str(buffer_root / "buffer"),
            "versions_dir": str(buffer_root / "versions"),
        }
    return {
        "method": "dflash",
        "model": str(DEMO / "drafter"),
        "num_speculative_tokens": 7,
        "adaflash": adaflash,
    }


def _engine(spec: dict, concurrency: int):
    from vllm import LLM

    return LLM(
        str(DEMO / "target"),
        max_num_seqs=concurrency,
        enforce_eager=True,
        max_model_len=1024,
        dtype="float32",
        speculative_config=spec,
    )


def _engine_cpu_s(llm) -> float:
    """CPU seconds (user + system) of the engine-core process and its threads."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    core = [p for p in procs if "EngineCore" in " ".join(p.cmdline() or [p.name()])]
    procs = core or procs
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())


def _round(llm, prompts, params) -> tuple[float, float, int]:
    """(tok/s, engine CPU ms per output token, output tokens) of one round."""
    cpu0, t0 = _engine_cpu_s(llm), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, _engine_cpu_s(llm) - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, 1e3 * cpu / tokens, tokens


def _mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% interval (normal approximation)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32, help="per round")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine (two here)
    from vllm import SamplingParams

    from adaflash_vllm.buffer import BufferReader

    root = Path(tempfile.mkdtemp(prefix="adaflash-logging-"))
    engines = {
        "adaflash": _engine(_spec(None), args.concurrency),
        "logging": _engine(_spec(root), args.concurrency),
    }
    raw = [
        json.loads(line)["prompt"]
        for line in (DEMO / "data" / "prompts_prose.jsonl").read_text().splitlines()
    ]
    tok = engines["adaflash"].get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r}], tokenize=False, add_generation_prompt=True
        )
        for r in raw
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:8], params, use_tqdm=False)
    rows: dict[str, list[tuple[float, float, int]]] = {n: [] for n in engines}
    n = args.num_prompts
    for i in range(args.rounds):
        batch = [prompts[(i * n + j) % len(prompts)] for j in range(n)]
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            rows[name].append(_round(engines[name], batch, params))
        a, lg = rows["adaflash"][-1], rows["logging"][-1]
        print(
            f"round {i + 1:3d}  adaflash {a[0]:7.1f} tok/s {a[1]:6.3f} cpu-ms/tok  "
            f"logging {lg[0]:7.1f} tok/s {lg[1]:6.3f} cpu-ms/tok  "
            f"ratio {lg[0] / a[0]:.3f}",
            flush=True,
        )
    pairs = list(zip(rows["adaflash"], rows["logging"], strict=True))
    tok_ratio = [lg[0] / a[0] for a, lg in pairs]
    cpu_ratio = [lg[1] / a[1] for a, lg in pairs]
    tok_m, tok_h = _mean_ci(tok_ratio)
    cpu_m, cpu_h = _mean_ci(cpu_ratio)
    time.sleep(1.0)  # the writer thread flushes its queue
    records = len(BufferReader(root / "buffer").read_new())
    served = args.rounds * args.num_prompts + 8  # + the warm-up
    print(
        f"logging / adaflash tok/s: mean {tok_m:.3f} +- {tok_h:.3f} (95%), median "
        f"{statistics.median(tok_ratio):.3f}; engine CPU per token: {cpu_m:.3f} "
        f"+- {cpu_h:.3f}; buffer records {records} (requests served with logging: "
        f"{served})"
    )
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "tok_s_ratio_mean": tok_m,
                "tok_s_ratio_ci95": tok_h,
                "tok_s_ratio_median": statistics.median(tok_ratio),
                "cpu_per_token_ratio_mean": cpu_m,
                "cpu_per_token_ratio_ci95": cpu_h,
                "tok_s": {
                    k: statistics.median(r[0] for r in v) for k, v in rows.items()
                },
                "buffer_records": records,
            }
        )
    )


if __name__ == "__main__":
    main()
