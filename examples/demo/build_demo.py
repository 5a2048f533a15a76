"""Build the bundled demo data, tokenizer and target model of `adaflash demo`.

Run (from the repository root, in the project virtualenv):
    python examples/demo/build_demo.py                      # all stages
    python examples/demo/build_demo.py --stage data         # one stage
    python examples/demo/build_demo.py --stage target --force --set max_steps=200
Then check the target in vLLM: `python examples/demo/check_target.py`.

Stages (each skips work whose output exists, unless --force):
    data       examples/demo/data/: prompt sets, train_target.jsonl, licenses,
               ATTRIBUTION.md (demo_data.py). ~4.3 MB, a few seconds.
    tokenizer  byte-level BPE, 4096 tokens, trained on train_target.jsonl
               (demo_target.py), saved into examples/demo/target/. ~30 s.
    target     examples/demo/target/: Qwen3ForCausalLM, ~5.8 M parameters, bf16
               safetensors ~12 MB, model card. ~35 min on 2 CPU cores.
    drafter    examples/demo/drafter/: a 1-layer DFlash drafter (block 8) with a
               length head, trained with `adaflash train-drafter` on the target's
               own answers to 640 PROSE prompts of train_target.jsonl only, so math
               and code are out of its distribution. ~6 min on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import demo_card
import demo_data
import demo_target

DEMO_DIR = Path(__file__).resolve().parent
STAGES = ("data", "tokenizer", "target", "drafter")
DRAFTER_ARGS = [
    "--domain",
    "prose",
    "--num-prompts",
    "640",
    "--max-tokens",
    "160",
    "--block-size",
    "8",
    "--num-layers",
    "1",
    "--epochs",
    "6",
    "--batch-size",
    "8",
    "--num-anchors",
    "32",
    "--lr",
    "1e-3",
    "--length-head",
    "64",
]


def _parse_sets(pairs: list[str]) -> dict:
    """`key=value` overrides of TargetConfig; unknown keys are an error."""
    fields = {f.name: f for f in dataclasses.fields(demo_target.TargetConfig)}
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {key}: unknown key; valid: {', '.join(fields)}")
        out[key] = type(demo_target.TargetConfig.__dict__[key])(value)
    return out


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stage_data(out: Path, shared: Path, force: bool) -> str:
    data_dir = out / "data"
    if (data_dir / "ATTRIBUTION.md").exists() and not force:
        return f"data: exists ({_folder_bytes(data_dir) / 1e6:.2f} MB), skipped"
    build = demo_data.collect(shared)
    sizes = demo_data.write(data_dir, build)
    for name, rows in build.files.items():
        print(f"  {name:28s} {len(rows):6d} records {sizes[name] / 1e6:6.2f} MB")
    return f"data: wrote {data_dir} ({_folder_bytes(data_dir) / 1e6:.2f} MB)"


def stage_tokenizer(out: Path, cfg: demo_target.TargetConfig, force: bool) -> str:
    tok_dir = out / "target"
    if (tok_dir / "tokenizer.json").exists() and not force:
        return "tokenizer: exists, skipped"
    tok = demo_target.build_tokenizer(
        out / "data" / "train_target.jsonl", tok_dir, cfg.vocab_size
    )
    return f"tokenizer: wrote {tok_dir} (vocab {len(tok)})"


def stage_target(out: Path, cfg: demo_target.TargetConfig, force: bool) -> str:
    import torch
    import transformers

    target_dir = out / "target"
    if (target_dir / "model.safetensors").exists() and not force:
        return "target: exists, skipped"
    print(f"target config: {json.dumps(dataclasses.asdict(cfg))}", flush=True)
    summary = demo_target.train_target(
        train_path=out / "data" / "train_target.jsonl",
        tok_dir=target_dir,
        out_dir=target_dir,
        cfg=cfg,
    )
    summary["command"] = "python " + shlex.join([str(Path(sys.argv[0]))] + sys.argv[1:])
    summary["torch"] = torch.__version__
    summary["transformers"] = transformers.__version__
    (target_dir / "training_summary.json").write_text(json.dumps(summary, indent=1))
    samples = demo_target.hf_samples(target_dir, demo_card.sample_prompts(out / "data"))
    (target_dir / "samples.json").write_text(
        json.dumps({"engine": "transformers", "samples": samples}, indent=1)
    )
    demo_card.write_card(target_dir)
    val = summary["final_val"]
    return (
        f"target: {summary['num_params'] / 1e6:.2f} M params, "
        f"{summary['train_tokens']:,} tokens in {summary['train_wall_s'] / 60:.1f} "
        f"min, train loss {summary['final_train_loss']:.3f}, val "
        + ", ".join(f"{d} {val[d]:.3f}" for d in demo_target.DOMAINS)
    )


def stage_drafter(out: Path, force: bool) -> str:
    """`adaflash train-drafter` with DRAFTER_ARGS, then copy its checkpoint here."""
    import shutil
    import subprocess

    dest = out / "drafter"
    if (dest / "model.safetensors").exists() and not force:
        return "drafter: exists, skipped"
    run = out.parent.parent / "runs" / "demo-drafter"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "adaflash_vllm.cli",
        "train-drafter",
        "--target",
        str(out / "target"),
        "--prompts",
        str(out / "data" / "train_target.jsonl"),
        "--out",
        str(run),
        *DRAFTER_ARGS,
    ]
    print("  " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run / "drafter", dest)
    metrics = json.loads((run / "metrics.json").read_text())
    return f"drafter: wrote {dest} (held-out prose tau {metrics['tau_eval']:.2f})"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    p.add_argument("--force", action="store_true", help="redo existing outputs")
    p.add_argument("--out", type=Path, default=DEMO_DIR, help="demo folder")
    p.add_argument(
        "--shared-data",
        type=Path,
        default=demo_data.DEFAULT_SHARED,
        help="the converted public prompt sets (with MANIFEST.md, index.json)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a TargetConfig field, e.g. max_steps=200 time_budget_s=60",
    )
    args = p.parse_args()
    cfg = demo_target.TargetConfig(**_parse_sets(args.set))
    stages = STAGES if args.stage == "all" else (args.stage,)
    report = []
    for stage in stages:
        t0 = time.perf_counter()
        print(f"== stage {stage}", flush=True)
        if stage == "data":
            line = stage_data(args.out, args.shared_data, args.force)
        elif stage == "tokenizer":
            line = stage_tokenizer(args.out, cfg, args.force)
        elif stage == "target":
            line = stage_target(args.out, cfg, args.force)
        else:
            line = stage_drafter(args.out, args.force)
        report.append(f"{line} [{time.perf_counter() - t0:.0f} s]")
    print("\nsummary:")
    for line in report:
        print(f"  {line}")


if __name__ == "__main__":
    main()
