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
import contextlib
import json
import math
import os
import re
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


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _cpu_s(pids: set[int]) -> float:
    """CPU seconds (user + system, all threads) of processes `pids`."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(psutil.Process(pid).cpu_times()[:2])
    return total


def _round(llm, pids, prompts, params) -> tuple[float, float, int]:
    """(tok/s, engine CPU ms per output token, output tokens) of one round; the
    engine's CPU is that of the processes it started (engine core, workers)."""
    cpu0, t0 = _cpu_s(pids), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, _cpu_s(pids) - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, 1e3 * cpu / tokens, tokens


def _mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% interval (normal approximation)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))


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
    (tok_m, tok_h), (cpu_m, cpu_h) = _mean_ci(tok), _mean_ci(cpu)
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
    engines, pids = {}, {}
    for name, spec in (("adaflash", _spec(None)), ("logging", _spec(root))):
        before = _children()
        engines[name] = _engine(spec, args.concurrency)
        pids[name] = _children() - before  # this engine's own processes
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
            rows[name].append(_round(engines[name], pids[name], batch, params))
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
