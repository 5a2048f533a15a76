"""What does trajectory logging cost? AdaFlash with online distillation on but no
trainer (every finished request is written to the buffer and the versions folder
is polled; no version ever comes) vs the same AdaFlash configuration without
online distillation, on the demo models, offline, both engines in one process,
measured in alternating rounds so that a slow spell of the machine hits both
alike.

Run (about 8 minutes on 2 cores):
    taskset -c 0 python examples/compare_logging.py --rounds 40

Per round it prints both engines' tok/s and CPU ms per output token (of the
engine's own processes: engine core with the log writer thread, and its worker),
then the logging / plain-AdaFlash ratio of the means with a 95% interval over the
per-round ratios (the rounds are paired), the records the buffer received, and one
JSON line. `--pool OUTPUT...` pools the rounds of runs saved that way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from adaflash_vllm.training.data import chat_prompts, load_prompts

from adaflash_vllm.bench.paired import (
    alternating_rounds,
    mean_ci,
    offline_engine,
    paired_ratios,
    start_engine,
)

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


_ROUND = re.compile(
    r"adaflash\s+([\d.]+) tok/s\s+([\d.]+) cpu-ms/tok\s+"
    r"logging\s+([\d.]+) tok/s\s+([\d.]+) cpu-ms/tok"
)


def pool(paths: list[str]) -> None:
    """The ratios over every round printed by earlier runs (their saved output)."""
    tok, cpu = [], []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            m = _ROUND.search(line)
            if m:
                a_tok, a_cpu, l_tok, l_cpu = map(float, m.groups())
                tok.append(l_tok / a_tok)
                cpu.append(l_cpu / a_cpu)
    (tok_m, tok_h), (cpu_m, cpu_h) = mean_ci(tok), mean_ci(cpu)
    print(
        f"{len(tok)} rounds: logging / adaflash tok/s {tok_m:.3f} +- {tok_h:.3f} "
        f"(95%), engine CPU per token {cpu_m:.3f} +- {cpu_h:.3f}"
    )
    print(
        json.dumps(
            {
                "rounds": len(tok),
                "tok_s_ratio_mean": tok_m,
                "tok_s_ratio_ci95": tok_h,
                "cpu_per_token_ratio_mean": cpu_m,
                "cpu_per_token_ratio_ci95": cpu_h,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32, help="per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="OUTPUT",
        help="no run: pool the rounds of earlier runs from their saved output",
    )
    args = p.parse_args()
    if args.pool:
        pool(args.pool)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine (two here)
    from vllm import SamplingParams

    from adaflash_vllm.buffer import BufferReader

    root = Path(tempfile.mkdtemp(prefix="adaflash-logging-"))
    engines = {
        name: start_engine(
            lambda spec=spec: offline_engine(
                str(DEMO / "target"), spec, args.concurrency
            )
        )
        for name, spec in (("adaflash", _spec(None)), ("logging", _spec(root)))
    }
    prompts = chat_prompts(
        engines["adaflash"][0].get_tokenizer(),
        [r["prompt"] for r in load_prompts(DEMO / "data" / "prompts_prose.jsonl")],
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm, _ in engines.values():  # warm-up
        llm.generate(prompts[:8], params, use_tqdm=False)

    def show(i: int, last: dict) -> None:
        a, lg = last["adaflash"], last["logging"]
        print(
            f"round {i + 1:3d}  adaflash {a.tok_s:7.1f} tok/s "
            f"{a.cpu_ms_per_token:6.3f} cpu-ms/tok  logging {lg.tok_s:7.1f} tok/s "
            f"{lg.cpu_ms_per_token:6.3f} cpu-ms/tok  ratio {lg.tok_s / a.tok_s:.3f}",
            flush=True,
        )

    rows = alternating_rounds(
        engines, prompts, params, args.rounds, args.num_prompts, on_round=show
    )
    ratios = paired_ratios(rows, "logging", "adaflash")
    tok_m, tok_h = ratios["tok_s_ratio_mean"], ratios["tok_s_ratio_ci95"]
    cpu_m, cpu_h = (
        ratios["cpu_per_token_ratio_mean"],
        ratios["cpu_per_token_ratio_ci95"],
    )
    time.sleep(1.0)  # the writer thread flushes its queue
    records = len(BufferReader(root / "buffer").read_new())
    served = args.rounds * args.num_prompts + 8  # + the warm-up
    print(
        f"logging / adaflash tok/s: mean {tok_m:.3f} +- {tok_h:.3f} (95%), median "
        f"{ratios['tok_s_ratio_median']:.3f}; engine CPU per token: {cpu_m:.3f} "
        f"+- {cpu_h:.3f}; buffer records {records} (requests served with logging: "
        f"{served})"
    )
    print(
        json.dumps(
            {
                **ratios,
                "tok_s": {
                    k: statistics.median(r.tok_s for r in v) for k, v in rows.items()
                },
                "buffer_records": records,
            }
        )
    )


if __name__ == "__main__":
    main()
