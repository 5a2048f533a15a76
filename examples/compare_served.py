"""Served paired passes: several `vllm serve` configurations of the demo models up
at once (all pinned to the same core, idle while another is measured), each pass
the same requests at a fixed client concurrency, configurations in a rotating
order. Prints every pass's tok/s, the draft gate's skipped share and tau, the
CPU time each server's API server and engine core spent per output token, each
AdaFlash server's gate state per batch-size bucket and its step-cost curve
against its startup profile at the end (saved as OUT/CONFIG-gate.json and, the
whole budget state, OUT/CONFIG-budget-state.json), then each configuration's
per-pass ratios to plain (mean with a 95% interval) and one JSON line.

Run (about 8 minutes on 2 cores for the default):
    python examples/compare_served.py --configs plain,cost_aware,single \
        --concurrency 32 --requests 256 --passes 3

Configurations (K = 7, the demo drafter):
    plain        no speculation
    dflash       stock vLLM DFlash
    noskip       AdaFlash `cost_aware` with `skip_drafting: false` (always drafts)
    no_draft     AdaFlash that never drafts (every step writes the drafter's
                 context K/V and verifies 0 drafts; `adaflash_debug_draft_every`)
    noctx        the same without writing the drafter's context K/V (what never
                 drafting costs besides that upkeep; `adaflash_debug_context_upkeep`)
    paper        AdaFlash `paper` budgets (the paper's rule, drafting every step)
    cost_aware   AdaFlash `cost_aware`, draft gate per batch-size bucket (default;
                 `retire_when_skipping` on, the default since run 34)
    retire       the same with `retire_when_skipping` set explicitly
    noretire     the same with `retire_when_skipping: false` (every request
                 keeps the drafter's context upkeep; the default before run 34)
    single       the same with one draft gate for every batch size
                 (`adaflash_debug_gate` with `per_batch_size: 0`)
    nocap        the same without the budgets' cap on the drafter's block
                 (`adaflash_debug_block_cap`; as before run 32)

The variants that need an RPC get it through `vllm serve`'s /collective_rpc
(`VLLM_SERVER_DEV_MODE=1`, on every server here so that all run the same server).
With `--requests` well above the concurrency the passes approach a steady load;
with twice the concurrency (the sweep's default) each pass ends in a drain where
the batch shrinks as the last requests finish. With one output length for all
(`--length-spread 0`) a batch that never drafts runs in lockstep: every request
starts and ends at the same step, and new prompts are prefilled together.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"
_BENCH_NAME = {  # bench.configs names; plain and dflash are their own
    "no_draft": "adaflash:fixed",  # drafting turned off over RPC
    "noctx": "adaflash:fixed",  # and the context upkeep too
    "noskip": "adaflash:cost_aware",  # skip_drafting turned off below
    "cost_aware": "adaflash:cost_aware",
    "paper": "adaflash:paper",
    "retire": "adaflash:cost_aware",  # retire_when_skipping set below
    "noretire": "adaflash:cost_aware",  # and unset
    "single": "adaflash:cost_aware",  # one gate set over RPC
    "nocap": "adaflash:cost_aware",  # the budgets' block cap off over RPC
}
_RPC = {  # the calls each configuration gets once its server is up
    "no_draft": [("adaflash_debug_draft_every", [10**9])],
    "noctx": [
        ("adaflash_debug_draft_every", [10**9]),
        ("adaflash_debug_context_upkeep", [False]),
    ],
    "single": [("adaflash_debug_gate", [{"per_batch_size": 0}])],
    "nocap": [("adaflash_debug_block_cap", [False])],
}


def _setup():
    from adaflash_vllm.bench.configs import BenchSetup

    return BenchSetup(str(DEMO / "target"), str(DEMO / "drafter"), 7)


def _config(config: str):
    """The bench configuration behind each name here (`bench.configs`)."""
    from adaflash_vllm.bench.configs import BenchConfig, build_config

    spec = build_config(_BENCH_NAME.get(config, config), _setup()).speculative_config
    if config == "noskip":
        spec["adaflash"]["length"]["skip_drafting"] = False
    if config in ("retire", "noretire"):
        spec["adaflash"]["length"]["retire_when_skipping"] = config == "retire"
    return BenchConfig(name=config, speculative_config=spec)


def _server(config: str, concurrency: int, out: Path, cores: str):
    from adaflash_vllm.bench.harness import MAX_MODEL_LEN, config_server

    engine = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": max(concurrency, 8),
        "enforce_eager": True,
    }
    log = out / f"{config}.log"
    server = config_server(_config(config), _setup(), engine, cores, log)
    server.env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc
    server.start()
    for method, rpc_args in _RPC.get(config, []):
        _rpc(server, method, rpc_args)
    return server


def _rpc(server, method: str, args: list) -> dict | None:
    """One /collective_rpc call: {"results": [one per worker]} (None if empty)."""
    body = json.dumps({"method": method, "args": args}).encode()
    request = urllib.request.Request(
        server.url + "/collective_rpc",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read() or b"null")


def _budget_state(server) -> dict:
    reply = _rpc(server, "adaflash_budget_state", []) or {}
    return (reply.get("results") or [{}])[0] or {}


def _print_cost_curve(config: str, cost: dict | None) -> None:
    """The step-cost curve a server learnt (ms at each profiled token count, the
    shared level added) next to its startup profile."""
    if not cost:
        return
    level = cost["level_ms"]
    print(
        f"{config:>10} cost curve after {cost['observations']} steps "
        f"(level {level:+.2f} ms): "
        + " ".join(
            f"{n}:{p:.1f}->{t + level:.1f}"
            for n, p, t in zip(
                cost["sizes"], cost["profile_ms"], cost["times_ms"], strict=True
            )
        ),
        flush=True,
    )


def _cpu_seconds(server) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process of `server`'s tree, by
    role: the API server (the `vllm serve` process) and everything under it (the
    engine core; on a CPU build no other child does work)."""
    import psutil

    from adaflash_vllm.bench.paired import cpu_seconds

    root = psutil.Process(server.proc.pid)
    below = {p.pid for p in root.children(recursive=True)}
    return {"api_server": cpu_seconds({root.pid}), "engine_core": cpu_seconds(below)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="plain,cost_aware,single")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256, help="per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="output lengths drawn (seeded) from max-tokens * [1 - S, 1 + S]",
    )
    p.add_argument("--prompts", default="prose", help="prompt set (bench sets)")
    p.add_argument(
        "--unique-prompts",
        type=int,
        default=None,
        help="send only this many distinct prompts, cycled (as the sweep sends its "
        "--num-prompts prompts at every level; repeats hit the prefix cache)",
    )
    p.add_argument("--cores", default="0", help="the servers' cores")
    p.add_argument("--out", default="runs/compare-served")
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - {"plain", "dflash", *_BENCH_NAME})
    if unknown or "plain" not in configs:
        p.error(f"unknown configurations {unknown} (plain is required)")

    from transformers import AutoTokenizer

    from adaflash_vllm.bench.online import measure_level, warm_up
    from adaflash_vllm.bench.paired import mean_ci
    from adaflash_vllm.bench.workloads import load_phase

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = str(DEMO / "target")
    distinct = min(args.unique_prompts or args.requests, args.requests)
    prompts = load_phase(
        args.prompts, AutoTokenizer.from_pretrained(target), count=distinct
    ).prompts
    prompts = (prompts * (args.requests // len(prompts) + 1))[: args.requests]
    workload = {  # what measure_level reads: output lengths drawn per request
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "output_len_spread": args.length_spread,
    }
    servers, gates = {}, {}
    try:
        for config in configs:
            servers[config] = _server(config, args.concurrency, out, args.cores)
        for server in servers.values():
            warm_up(server, target, prompts, args.concurrency)
        tok_s: dict[str, list[float]] = {c: [] for c in configs}
        cpu_ms = {c: {"api_server": [], "engine_core": []} for c in configs}
        for i in range(args.passes):
            shift = i % len(configs)
            for config in configs[shift:] + configs[:shift]:
                before = _cpu_seconds(servers[config])
                rate, reqs, spec, extra = measure_level(
                    servers[config], target, prompts, args.concurrency, workload
                )
                after = _cpu_seconds(servers[config])
                tokens = sum(r.get("tokens", 0) for r in reqs)
                for role in after:
                    cpu_ms[config][role].append(
                        1000 * (after[role] - before[role]) / max(1, tokens)
                    )
                failed = sum(not r.get("ok") for r in reqs)
                tok_s[config].append(rate)
                gate = extra.get("gate_skipped_share")
                line = f"pass {i} {config:>10}: {rate:7.1f} tok/s tau {spec['tau']:.2f}"
                if gate is not None:
                    line += f" skipped {gate:.0%}"
                if failed:
                    line += f" FAILED {failed}"
                line += " | CPU ms/token: " + " ".join(
                    f"{role} {v[-1]:.3f}" for role, v in cpu_ms[config].items()
                )
                print(line, flush=True)
        for c in (c for c in configs if c in _BENCH_NAME):  # AdaFlash servers
            state = _budget_state(servers[c])
            (out / f"{c}-budget-state.json").write_text(json.dumps(state, indent=1))
            gates[c] = (state.get("draft_gate") or {}).get("buckets")
            _print_cost_curve(c, state.get("cost_model"))
            retired = state.get("retired")
            if retired is not None:  # retire_when_skipping's counts
                print(f"{c:>10} retired: {json.dumps(retired)}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    for config, buckets in gates.items():
        if buckets is None:  # no gate (no_draft's scripted one has no buckets)
            continue
        (out / f"{config}-gate.json").write_text(json.dumps(buckets, indent=1))
        for size, g in buckets.items():  # what each batch size settled on
            print(
                f"{config:>10} gate, batch <= {size:>3}: drafted "
                f"{g['drafted_steps']:>5} skipped {g['skipped_steps']:>5} steps, "
                f"tokens/ms draft {g['draft_tokens_per_ms'] or 0:.3f} "
                f"skip {g['skip_tokens_per_ms'] or 0:.3f}, "
                f"now {'drafting' if g['drafting'] else 'skipping'}"
            )
    summary = {
        "concurrency": args.concurrency,
        "requests": args.requests,
        "unique_prompts": distinct,
        "length_spread": args.length_spread,
    }
    for config in configs:
        ratios = [a / b for a, b in zip(tok_s[config], tok_s["plain"], strict=True)]
        mean, half = mean_ci(ratios)
        half = None if half != half else half  # one pass: no interval (not NaN)
        summary[config] = {
            "tok_s": tok_s[config],
            "vs_plain": mean,
            "ci95": half,
            "cpu_ms_per_token": cpu_ms[config],
        }
        each = " ".join(f"{r:.3f}" for r in ratios)
        spread = "" if half is None else f" +- {half:.3f}"
        print(f"{config:>10} / plain: {mean:.3f}{spread} (per pass {each})")
        print(
            f"{config:>10} CPU ms per output token: "
            + " ".join(
                f"{role} {sum(v) / len(v):.3f}" for role, v in cpu_ms[config].items()
            )
        )
    print(json.dumps(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
