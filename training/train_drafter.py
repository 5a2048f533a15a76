"""`adaflash train-drafter`: train a DFlash drafter for any Qwen3-architecture target.

Steps: (a) the target answers the prompts through vLLM (its chat template, greedy by
default), cached in OUT/sequences.jsonl; (b) target features are recomputed per
batch; (c) the DFlash recipe trains the drafter (offline.py); (d) tau is measured
on held-out prompts exactly as greedy verification would count it; (e) OUT/drafter
is a z-lab checkpoint that loads in stock vLLM `method: "dflash"` and in AdaFlash.

Run: adaflash train-drafter --target examples/demo/target \
        --prompts examples/demo/data/prompts_prose.jsonl --out runs/drafter
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from adaflash_vllm.proposers.length_head import (
    CONFIG_KEY,
    HISTORY_KEY,
    KIND_KEY,
    make_length_head,
)
from adaflash_vllm.training.checkpoint import drafter_config
from adaflash_vllm.training.data import (
    Sequence,
    load_prompts,
    load_sequences,
    regenerate,
    save_sequences,
)
from adaflash_vllm.training.head import evaluate_length_head, train_length_head
from adaflash_vllm.training.offline import (
    OfflineTrainConfig,
    OfflineTrainer,
    evaluate_tau,
    load_or_init_drafter,
)

from adaflash_vllm.errors import AdaFlashConfigError


def add_train_drafter_args(p: argparse.ArgumentParser) -> None:
    d = OfflineTrainConfig()
    p.add_argument("--target", required=True, help="target model folder (HF format)")
    p.add_argument("--prompts", required=True, help="JSONL prompt file (`prompt`)")
    p.add_argument("--out", required=True, help="output folder (resumable)")
    p.add_argument("--eval-prompts", help="held-out JSONL (default: split --prompts)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N")
    p.add_argument(
        "--domain", default=None, help="only prompts whose `domain` field equals this"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="response length")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration T")
    p.add_argument("--init", help="start from this drafter checkpoint")
    p.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    p.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        help="target layers to read (default: spread over the depth)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="DFlash block: 1 anchor + (block-1) drafts",
    )
    p.add_argument("--num-anchors", type=int, default=d.num_anchors)
    p.add_argument("--gamma", type=float, default=d.gamma, help="position decay")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=float, default=d.warmup)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument(
        "--length-head",
        type=int,
        default=64,
        metavar="D",
        help="train a length head with bottleneck D after the drafter (0: none)",
    )
    p.add_argument(
        "--head-only",
        action="store_true",
        help="keep the --init drafter's weights and train only a new length head "
        "(e.g. for a z-lab drafter, which ships without one)",
    )
    p.add_argument(
        "--head-history",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the new length head also reads each request's previous round "
        "(dflash_config.length_head_history; trained on served chains)",
    )
    p.add_argument(
        "--head-epochs", type=int, default=20, help="passes over the head's blocks"
    )
    p.add_argument(
        "--head-anchors",
        type=int,
        default=None,
        help="blocks per sequence for the head (default: every position; each "
        "block keeps 2 * hidden + 3 * K floats in memory; a head with history "
        "always takes every position and its served chains)",
    )
    p.add_argument("--head-lr", type=float, default=2e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument("--seed", type=int, default=d.seed)


def default_layer_ids(num_layers: int, count: int = 3) -> list[int]:
    """`count` layers spread from 1 to L-2 (DFlash spreads over the depth)."""
    if num_layers <= 2:
        return list(range(num_layers))
    lo, hi = 1, num_layers - 2
    n = min(count, hi - lo + 1)
    return sorted({round(lo + i * (hi - lo) / max(1, n - 1)) for i in range(n)})


def _head_keys(bottleneck: int, history: bool) -> dict:
    """The dflash_config keys of a new survival length head."""
    return {CONFIG_KEY: bottleneck, KIND_KEY: "survival", HISTORY_KEY: history}


def _replace_length_head(drafter, bottleneck: int, seed: int, history: bool) -> None:
    """Give `drafter` a fresh survival length head of bottleneck D (its config
    names it, so the checkpoint it saves loads with the head), initialised from
    `seed` alone (not from whatever head the checkpoint had)."""
    import torch

    drafter.cfg.setdefault("dflash_config", {}).update(_head_keys(bottleneck, history))
    torch.manual_seed(seed)
    drafter.length_head = make_length_head(drafter.cfg)


def mask_token_of(target: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    if mask is None or mask == tok.unk_token_id:
        raise AdaFlashConfigError(
            f"{target}'s tokenizer has no <|mask|> token; DFlash needs an unused token "
            "as mask (add one, or train a drafter with an explicit config)."
        )
    return mask


def regenerate_sequences(
    target: Path, prompts: list[dict], *, max_tokens: int, temperature: float, seed: int
) -> list[Sequence]:
    """The target's own responses to `prompts`, through vLLM on this machine."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    llm = LLM(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        seed=seed,
        max_model_len=2048,
    )
    try:
        return regenerate(
            llm,
            prompts,  # records: a `history` comes before its prompt
            max_tokens=max_tokens,
            temperature=temperature,
            domains=[r.get("domain", "") for r in prompts],
            seed=seed,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def main_train_drafter(args: argparse.Namespace) -> dict:
    import torch
    from adaflash_vllm.training.features import TargetModel

    if args.head_only and not (args.init and args.length_head):
        raise AdaFlashConfigError(
            "--head-only trains a length head for an existing drafter: give --init "
            "DRAFTER and --length-head D (D > 0)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Path(args.target)
    records = load_prompts(args.prompts)
    if args.domain:
        records = [r for r in records if r.get("domain") == args.domain]
        if not records:
            raise AdaFlashConfigError(
                f"{args.prompts} has no prompts with domain {args.domain!r}"
            )
    records = records[: args.num_prompts] if args.num_prompts else records
    if args.eval_prompts:
        train_recs, eval_recs = records, load_prompts(args.eval_prompts)
    else:
        n_eval = max(1, int(len(records) * args.eval_fraction))
        train_recs, eval_recs = records[n_eval:], records[:n_eval]
    seq_path = out / "sequences.jsonl"
    if seq_path.exists():
        seqs = load_sequences(seq_path)
    else:
        seqs = regenerate_sequences(
            target,
            train_recs + eval_recs,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
        save_sequences(seq_path, seqs)
    train_seqs, eval_seqs = seqs[: len(train_recs)], seqs[len(train_recs) :]

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    tgt = TargetModel(target)
    cfg = OfflineTrainConfig(
        block_size=args.block_size,
        num_anchors=args.num_anchors,
        gamma=args.gamma,
        lr=args.lr,
        warmup=args.warmup,
        grad_clip=args.grad_clip,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        bf16=args.bf16,
        save_every=args.save_every,
    )
    if args.init:
        drafter = load_or_init_drafter(args.init, None)
        if args.head_only:
            _replace_length_head(
                drafter, args.length_head, args.seed, args.head_history
            )
    else:
        layer_ids = args.target_layer_ids or default_layer_ids(tgt.num_layers)
        drafter = load_or_init_drafter(
            None,
            drafter_config(
                target_config=tgt.config,
                num_layers=args.num_layers,
                target_layer_ids=layer_ids,
                mask_token_id=mask_token_of(target),
                block_size=args.block_size,
                extra_dflash=(
                    _head_keys(args.length_head, args.head_history)
                    if args.length_head
                    else None
                ),
            ),
        )
    k = drafter.block_size - 1
    # A drafter from --init keeps its own block size.
    cfg = dataclasses.replace(cfg, block_size=drafter.block_size)
    before = evaluate_tau(drafter, tgt, eval_seqs, k)
    trainer = OfflineTrainer(tgt, drafter, cfg, out)
    t0 = time.perf_counter()
    state = trainer.state if args.head_only else trainer.train(train_seqs)
    wall = time.perf_counter() - t0
    after = before if args.head_only else evaluate_tau(drafter, tgt, eval_seqs, k)
    head_metrics = None
    if drafter.length_head is not None:
        losses = train_length_head(
            drafter.length_head,
            drafter,
            tgt,
            train_seqs,
            num_drafts=k,
            epochs=args.head_epochs,
            lr=args.head_lr,
            num_anchors=args.head_anchors,
            seed=args.seed,
        )
        head_metrics = evaluate_length_head(
            drafter.length_head, drafter, tgt, eval_seqs, num_drafts=k
        )
        head_metrics["final_train_loss"] = losses[-1] if losses else None
    metrics = {
        "tau_eval_before": before["tau"],
        "tau_eval": after["tau"],
        "tau_eval_detail": after,
        "steps": state.step,
        "final_loss": state.losses[-1] if state.losses else None,
        "train_tokens_per_s": state.tokens_seen / max(state.seconds, 1e-9),
        "train_wall_s": wall,
        "train_sequences": len(train_seqs),
        "eval_sequences": len(eval_seqs),
        "config": asdict(cfg),
        "target": str(target),
        "prompts": str(args.prompts),
        "length_head_calibration": head_metrics,
        "head_only": bool(args.head_only),
    }
    trainer.save_checkpoint(out / "drafter", metrics=metrics)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    return metrics


def add_eval_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder")
    p.add_argument(
        "--prompts",
        required=True,
        nargs="+",
        help="JSONL prompt files (one tau per file)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="leave out each file's first N prompts (evaluate the next ones)",
    )
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results JSON here")


def main_eval_drafter(args: argparse.Namespace) -> dict:
    """tau (and length-head calibration) of a drafter on target-regenerated
    responses to each prompt file, counted as greedy verification would."""
    import torch
    from adaflash_vllm.training.features import TargetModel

    first = args.skip_prompts
    sets = {
        Path(p).stem: load_prompts(p)[first : first + args.num_prompts]
        for p in args.prompts
    }
    flat = [r for recs in sets.values() for r in recs]
    seqs = regenerate_sequences(
        Path(args.target),
        flat,
        max_tokens=args.max_tokens,
        temperature=0.0,
        seed=args.seed,
    )
    torch.set_num_threads(os.cpu_count() or 1)
    tgt = TargetModel(args.target)
    drafter = load_or_init_drafter(args.drafter, None)
    k = drafter.block_size - 1
    results, start = {}, 0
    for name, recs in sets.items():
        part = seqs[start : start + len(recs)]
        start += len(recs)
        res = evaluate_tau(drafter, tgt, part, k)
        if drafter.length_head is not None:
            res["length_head"] = evaluate_length_head(
                drafter.length_head, drafter, tgt, part, num_drafts=k
            )
        results[name] = res
    results["_meta"] = {
        "target": args.target,
        "drafter": args.drafter,
        "num_prompts": args.num_prompts,
        "skip_prompts": args.skip_prompts,
        "max_tokens": args.max_tokens,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return results
