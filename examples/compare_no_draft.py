"""What does a spec-decode step cost when it drafts nothing? Plain vLLM vs AdaFlash
with a gate that never drafts (every step only writes the drafter's context K/V and
verifies 0 drafts), offline on the demo models, engines in one process, in paired
rounds (`adaflash_vllm.bench.paired`: the same batch to each, alternating order).

Run (about 6 minutes on 2 cores):
    taskset -c 0 python examples/compare_no_draft.py --concurrency 32 --rounds 20

`--staggered` draws each prompt's output length (seeded), so that requests end at
different steps and new prompts start while others decode, as they do when served;
without it every batch starts and ends together.

`--configs` adds others to compare against plain: `dflash` (stock vLLM DFlash,
K = 7; `dflash:K` for another K), `adaflash` (AdaFlash `cost_aware` as served
by the demo, gate on), `adaflash:adaptive_block` (the same with
`length.adaptive_block: true`, the default since run 23), `adaflash:fullblock`
(`adaptive_block: false`: the drafter's full block always), `adaflash:explored`
(the gate's checks of skipping explore it, as before run 23), `adaflash:nohist`
(a length head with history never reads the previous round), `adaflash:nocap`
(chosen budgets never cap the drafter's block, as before run 32), `adaflash:noskip`
(`skip_drafting: false`), `adaflash:retire` (`retire_when_skipping: true`,
the default since run 34; `adaflash:noretire` sets it false),
`adaflash:nosteady` (`steady_skip: false`: every skipped step in full, as
before run 43), `adaflash:noplain` (steady skipped steps through the runner's
spec-decode path, not as plain decoding steps: as before run 44),
`adaflash:eagerchecks` (the draft gate's checks of drafting under load
not spaced by what they lose, as before run 31), `adaflash:perreqcap` (checks
spaced by what they lose wait at most 16 steps per request, as before run 45),
`adaflash:fixed` (`length.mode: fixed`: AdaFlash verifying all K drafts),
`adaflash:kN` (the same with `num_speculative_tokens` N instead of 7: its
drafter's length head, trained for 7, is then left out; variants combine with
`+`, e.g. `adaflash:k5+noskip`),
`adaflash:never` (`cost_aware` with a gate that never drafts: what the policy's
own upkeep costs on skipped steps, against `no_draft`) and `adaflash:z2` (the
draft gate switching modes only past 2 standard errors, set
with the `adaflash_debug_gate` RPC).
Per round it prints every engine's tok/s and CPU ms per output token (of the
engine's own processes); then, for each configuration, its ratio to plain (means
of the per-round ratios with 95% intervals), for AdaFlash ones also to `dflash`,
`no_draft` and `adaflash:noskip` when those ran, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEMO = Path(__file__).resolve().parent / "demo"
ALT_DRAFTER_ENV = "ADAFLASH_ALT_DRAFTER"  # the `adaflash:alt` drafter folder


# adaflash:VARIANT: the demo's cost_aware configuration with one length key changed
_ADAFLASH_VARIANTS = {
    "adaptive_block": {"adaptive_block": True},
    "noskip": {"skip_drafting": False},
    "retire": {"retire_when_skipping": True},  # requests retire where skipping wins
    "noretire": {"retire_when_skipping": False},  # (the default before run 34)
    "nosteady": {"steady_skip": False},  # every skipped step in full (before run 43)
    "fixed": {"mode": "fixed"},  # AdaFlash's machinery, every request verifies K
    "paper": {"mode": "paper"},  # the head's rule for budgets, no gate (run 41)
    "z2": {},  # the gate switching only past 2 standard errors (_GATE_SETTINGS)
    "never": {},  # cost_aware whose gate never drafts (no_draft with its policy)
    "dipchecks": {},  # the gate before run 22 (_GATE_SETTINGS)
    "fullblock": {"adaptive_block": False},  # the drafter's full block always
    "explored": {},  # checks of skipping explore it (before run 23)
    "nohist": {},  # the length head never reads the previous round
    "nocap": {},  # chosen budgets never cap the block (before run 32)
    "noplain": {},  # steady skipped steps through the spec-decode path (before run 44)
    "slow01": {},  # long-run rate over ~100 one-request rounds at every B
    "slow04": {},  # long-run rate over ~25 rounds at one request (before run 25)
    "slowb1": {},  # long-run rate over ~13 rounds at two requests (before run 36)
    "eagerchecks": {},  # checks of drafting not spaced by their loss (before run 31)
    "perreqcap": {},  # ... spaced by it at most 16 steps per request (before run 45)
    "eagersmall": {},  # checks never spaced by their loss below 8 (before run 37)
    "spacedsmall": {},  # ... always spaced by it there (_GATE_SETTINGS)
    "longruns": {},  # drafting runs that lose end as before run 37
    "before37": {},  # both of run 37's changes off
    "retireclose": {},  # retiring once skipping leads at all (_GATE_SETTINGS)
    "noshift": {},  # revisited buckets ignore acceptance shifts (before run 41)
    "alt": {},  # the drafter folder $ADAFLASH_ALT_DRAFTER (e.g. a retrained head)
}
# adaflash:VARIANT: draft-gate parameters set on the running engine
_GATE_SETTINGS = {
    "z2": {"switch_z": 2.0},
    # checks of skipping at most 128 steps apart, and one at once on any dip of
    # drafting's recent rate, however far ahead its long-run rate is
    "dipchecks": {"decisive_max_interval": 128, "shift_slow_margin": float("inf")},
    # skipping's rate never predicted: every check of it skips steps
    "explored": {"skip_remeasure_steps": 0},
    "slow01": {"slow_ema_per_request": 0.01, "slow_ema_one_request": 0.01},
    # the long-run rate at one request as before run 25 (25 rounds)
    "slow04": {"slow_ema_one_request": 0.04},
    # the long-run rate at two requests as before run 36 (~13 rounds)
    "slowb1": {"slow_one_request_max_batch": 1},
    # checks of drafting under load back off from 8 steps whatever they lose
    "eagerchecks": {"check_share": 0.0},
    # ... and, spaced by what they lose, wait no longer than 16 steps per
    # request under 32 requests (before run 45)
    "perreqcap": {"check_share_max_interval": 0},
    # below 8 requests checks of drafting never spaced by their loss (before run 37)
    "eagersmall": {"check_value_ema": 0.0},
    # ... always spaced by it, whether or not checks paid (tried in run 37)
    "spacedsmall": {"check_share_min_batch": 1},
    # a drafting run that has lost against skipping waits for the recent rate
    # to fall a standard error below skipping's (before run 37)
    "longruns": {"run_loss_tokens": 0.0},
    "before37": {"check_value_ema": 0.0, "run_loss_tokens": 0.0},
    # requests retire from drafting once skipping's rate leads drafting's (both
    # the recent and the long-run one) beyond the noise, not by 1.25x
    "retireclose": {"retire_margin": 1.0},
    # a bucket back after an absence keeps its mode whatever first-position
    # acceptance did meanwhile (before run 41)
    "noshift": {"accept_drop": 0.0},
}


def _spec(config: str) -> dict | None:
    if config == "plain":
        return None
    name, _, k = config.partition(":")
    spec = {
        "method": "dflash",
        "model": str(DEMO / "drafter"),
        "num_speculative_tokens": int(k) if name == "dflash" and k else 7,
    }
    if config == "no_draft":
        spec["adaflash"] = {"length": {"mode": "fixed"}}
    elif name == "adaflash":
        length = {"mode": "cost_aware"}
        for part in _variant_parts(k):
            if _adaflash_k(part):
                spec["num_speculative_tokens"] = _adaflash_k(part)
            elif part == "alt":
                spec["model"] = _alt_drafter()
            else:
                length.update(_ADAFLASH_VARIANTS[part])
        spec["adaflash"] = {"length": length}
    return spec


def _alt_drafter() -> str:
    """The `adaflash:alt` drafter folder, from $ADAFLASH_ALT_DRAFTER."""
    folder = os.environ.get(ALT_DRAFTER_ENV)
    if not folder or not (Path(folder) / "config.json").is_file():
        raise ValueError(
            f"adaflash:alt needs {ALT_DRAFTER_ENV} set to a drafter folder "
            f"(with config.json), got {folder!r}"
        )
    return folder


def _variant_parts(variant: str) -> list[str]:
    """`adaflash:A+B`: the variants A and B together (e.g. `k5+noskip`)."""
    return [p for p in variant.split("+") if p]


def _adaflash_k(variant: str) -> int | None:
    """K of an `adaflash:kN` variant (AdaFlash with num_speculative_tokens N)."""
    if variant[:1] == "k" and variant[1:].isdigit() and int(variant[1:]) >= 1:
        return int(variant[1:])
    return None


def _adaflash_variant_ok(variant: str) -> bool:
    parts = _variant_parts(variant)
    return bool(parts) and all(p in _ADAFLASH_VARIANTS or _adaflash_k(p) for p in parts)


def parse_configs(text: str, no_draft_variants=frozenset()) -> list[str]:
    """ "plain" and the comma list `text` (no_draft[:VARIANT] only with a variant
    in `no_draft_variants`); ValueError names the first unknown one."""
    configs = ["plain"] + [c for c in text.split(",") if c and c != "plain"]
    for c in configs:
        name, _, k = c.partition(":")
        if name not in ("plain", "no_draft", "dflash", "adaflash") or not (
            k == ""
            or (name == "dflash" and k.isdigit() and int(k) >= 1)
            or (name == "adaflash" and _adaflash_variant_ok(k))
            or (name == "no_draft" and k in no_draft_variants)
        ):
            raise ValueError(f"unknown config {c!r}")
    return configs


def demo_prompts(tokenizer, domain: str = "prose") -> list[str]:
    """The demo's prompts of `domain` (prose, math or code), in the target's chat
    template."""
    from adaflash_vllm.training.data import chat_prompts, load_prompts

    path = DEMO / "data" / f"prompts_{domain}.jsonl"
    return chat_prompts(tokenizer, [r["prompt"] for r in load_prompts(path)])


def in_process_engines(kv_cache_gib: int) -> None:
    """Environment for engines built in this process (their workers in it too,
    so that tools can reach them): offline, `kv_cache_gib` of KV cache each
    unless VLLM_CPU_KVCACHE_SPACE says otherwise. Before vLLM is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _engine(config: str, concurrency: int, log_stats: bool = False):
    from adaflash_vllm.bench.paired import offline_engine

    llm = offline_engine(
        str(DEMO / "target"), _spec(config), concurrency, log_stats=log_stats
    )
    if config in ("no_draft", "adaflash:never"):
        llm.collective_rpc("adaflash_debug_draft_every", args=(10**9,))
    settings = {}
    parts = _variant_parts(config.partition(":")[2])
    for part in parts:
        settings.update(_GATE_SETTINGS.get(part, {}))
    if config.startswith("adaflash:") and settings:
        llm.collective_rpc("adaflash_debug_gate", args=(settings,))
    if "nohist" in parts:
        llm.collective_rpc("adaflash_debug_head_history", args=(False,))
    if "nocap" in parts:
        llm.collective_rpc("adaflash_debug_block_cap", args=(False,))
    if "noplain" in parts:
        llm.collective_rpc("adaflash_debug_steady_plain", args=(False,))
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64, help="per round")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument(
        "--log-stats",
        action="store_true",
        help="vLLM's per-step stats on in every engine, as `vllm serve` runs",
    )
    p.add_argument(
        "--staggered",
        action="store_true",
        help="output lengths drawn per prompt from [max_tokens / 3, 5 max_tokens / "
        "3] (seeded): requests end at different steps and new ones start while "
        "others decode, as under served traffic",
    )
    p.add_argument(
        "--configs",
        default="no_draft",
        help="comma list of no_draft, dflash[:K], adaflash[:adaptive_block|noskip|"
        "fixed|z2|never|dipchecks|retire|...] (each compared to plain)",
    )
    args = p.parse_args()
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        p.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine
    from vllm import SamplingParams

    from adaflash_vllm.bench.paired import (
        alternating_rounds,
        paired_ratios,
        staggered_params,
        start_engine,
    )

    engines = {
        c: start_engine(lambda c=c: _engine(c, args.concurrency, args.log_stats))
        for c in configs
    }
    prompts = demo_prompts(engines["plain"][0].get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm, _ in engines.values():  # warm-up
        llm.generate(prompts[:8], params, use_tqdm=False)
    if args.staggered:
        params = staggered_params(len(prompts), args.max_tokens)

    def show(i: int, last: dict) -> None:
        cells = "  ".join(
            f"{n} {r.tok_s:7.1f} tok/s {r.cpu_ms_per_token:6.3f} cpu-ms/tok"
            for n, r in last.items()
        )
        print(f"round {i + 1:3d}  {cells}", flush=True)

    rows = alternating_rounds(
        engines, prompts, params, args.rounds, args.num_prompts, on_round=show
    )
    summary = {"concurrency": args.concurrency, "vs_plain": {}}
    # Each configuration against plain; AdaFlash ones also against stock DFlash
    # K = 7, the floor (no_draft), AdaFlash without the gate and AdaFlash verifying
    # all K drafts, when those ran.
    pairs = [(c, "plain") for c in configs[1:]]
    for base in ("dflash", "no_draft", "adaflash:noskip", "adaflash:fixed"):
        if base in configs:
            pairs += [
                (c, base) for c in configs if c.startswith("adaflash") and c != base
            ]
    for c, base in pairs:
        r = paired_ratios(rows, c, base)
        summary.setdefault(f"vs_{base}", {})[c] = r
        print(
            f"{c} / {base}: tok/s {r['tok_s_ratio_mean']:.3f} +- "
            f"{r['tok_s_ratio_ci95']:.3f} (95%, median {r['tok_s_ratio_median']:.3f}); "
            f"CPU per token {r['cpu_per_token_ratio_mean']:.3f} +- "
            f"{r['cpu_per_token_ratio_ci95']:.3f}"
        )
    for name, (llm, _) in engines.items():  # what the gate and blocks settled on
        if not name.startswith("adaflash"):
            continue
        state = llm.collective_rpc("adaflash_budget_state")[0]
        gate, block = state["draft_gate"] or {}, state["block_length"] or {}
        counts = llm.collective_rpc("adaflash_sampler_stats")[0]
        rounds = max(sum(counts["verify_hist"]), 1)  # warm-up included
        summary.setdefault("adaflash_state", {})[name] = {
            "drafted_steps": gate.get("drafted_steps"),
            "skipped_steps": gate.get("skipped_steps"),
            "block_length": block.get("length"),
            "block_probes": block.get("probes"),
            "drafts_verified_per_round": sum(counts["drafted"]) / rounds,
            "drafts_accepted_per_round": sum(counts["accepted"]) / rounds,
            "budget_use": state.get("budget_use"),
            # per batch-size bucket: steps drafted / skipped, the mode it settled on
            "gate_buckets": {
                b: [g["drafted_steps"], g["skipped_steps"], g["drafting"]]
                for b, g in (gate.get("buckets") or {}).items()
            },
        }
        print(f"{name}: {summary['adaflash_state'][name]}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
