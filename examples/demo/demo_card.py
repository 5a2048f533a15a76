"""Model card (README.md) of the demo target, rendered from the build's records.

Run: written by `python examples/demo/build_demo.py --stage target` and rewritten
by `python examples/demo/check_target.py` (which adds the vLLM samples).

Inputs in the target folder: training_summary.json (from the target stage) and
samples.json ({"engine": ..., "samples": {domain: [{prompt, output}]}}).
"""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE_PROMPTS_PER_DOMAIN = 3
SAMPLE_MAX_PROMPT_CHARS = 400


def sample_prompts(data_dir: Path) -> dict[str, list[str]]:
    """The first few short held-out prompts of each domain, in file order."""
    out = {}
    for domain in ("prose", "math", "code"):
        rows = [
            json.loads(line)
            for line in (data_dir / f"prompts_{domain}.jsonl").open(encoding="utf-8")
        ]
        short = [
            r["prompt"] for r in rows if len(r["prompt"]) <= SAMPLE_MAX_PROMPT_CHARS
        ]
        out[domain] = short[:SAMPLE_PROMPTS_PER_DOMAIN]
    return out


def _fence(text: str) -> str:
    return "```text\n" + text.replace("```", "`\u200b``") + "\n```"


def render_card(target_dir: Path) -> str:
    """The README.md text for `target_dir`."""
    s = json.loads((target_dir / "training_summary.json").read_text())
    samples = json.loads((target_dir / "samples.json").read_text())
    cfg, val = s["config"], s["final_val"]
    size_mb = (target_dir / "model.safetensors").stat().st_size / 1e6
    lines = [
        "---",
        "license: other",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        "",
        "# adaflash demo target (tiny Qwen3, trained from scratch on CPU)",
        "",
        "The target model of `adaflash demo`: a small `Qwen3ForCausalLM` that writes",
        "prose, GSM8K/MathQA-style worked math solutions and MBPP-style Python, each",
        "in its own style, when prompted through its chat template. It exists so the",
        "demo can show a domain shift (prose -> math -> code) on a CPU. It is not a",
        "useful assistant: the style of each domain is recognisable, but answers are",
        "wrong, prose is mostly incoherent and greedy outputs fall into repetition",
        "loops (see the samples below).",
        "",
        "## Model",
        "",
        "| | |",
        "| --- | --- |",
        f"| parameters | {s['num_params']:,} (embeddings tied) |",
        f"| layers / hidden / MLP | {cfg['num_layers']} / {cfg['hidden_size']} / "
        f"{cfg['intermediate_size']} |",
        f"| attention | {cfg['num_heads']} query heads, {cfg['num_kv_heads']} KV "
        f"heads, head_dim {cfg['head_dim']} |",
        f"| vocabulary | {cfg['vocab_size']} (byte-level BPE, specials "
        "`<|endoftext|>` eos/pad, `<|im_start|>`, `<|im_end|>`, `<|mask|>`) |",
        f"| context | trained on {cfg['seq_len']}-token windows; "
        f"max_position_embeddings {cfg['max_position_embeddings']} |",
        f"| weights | `model.safetensors`, bf16, {size_mb:.1f} MB |",
        "",
        'Load it in vLLM with `dtype="float32"` (CPU). Generation stops at',
        "`<|im_end|>` or `<|endoftext|>` (generation_config.json).",
        "",
        "## How it was built",
        "",
        "```bash",
        "python examples/demo/build_demo.py --stage data",
        "python examples/demo/build_demo.py --stage tokenizer",
        s.get("command", "python examples/demo/build_demo.py --stage target"),
        "VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 "
        "python examples/demo/check_target.py",
        "```",
        "",
        "(`python examples/demo/build_demo.py` alone runs the three stages;",
        "check_target.py loads the model in vLLM and writes the samples below.)",
        "",
        "`examples/demo/build_demo.py` runs three stages: data (the bundled",
        "`examples/demo/data/`), tokenizer (BPE trained on `train_target.jsonl`) and",
        "target (this model). The recipe is in the docstring of",
        "`examples/demo/demo_target.py`: chat-templated documents packed into",
        "domain-pure windows, loss on all tokens, AdamW with warmup and cosine decay,",
        "bf16 autocast, seeds fixed.",
        "",
        "## Data and licenses",
        "",
        "`examples/demo/data/train_target.jsonl`, from GSM8K train (MIT), the MathQA",
        "test subset of math-evaluation-harness (MIT; MathQA Apache-2.0), MBPP",
        "train/validation/prompt (MIT repo; MBPP CC-BY-4.0) and prose documents made",
        "from ShareGPT first turns and Spec-Bench items (Apache-2.0). Sources,",
        "commits, counts and license texts: `examples/demo/data/ATTRIBUTION.md` and",
        "`examples/demo/data/licenses/`. The held-out demo prompts (`prompts_*.jsonl`)",
        "were not trained on. CodeAlpaca (non-commercial) was not used.",
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        "| documents | "
        + ", ".join(
            f"{d} {s['train_docs'][d]} train / {s['val_docs'][d]} val"
            for d in s["train_docs"]
        )
        + " |",
        f"| steps x batch | {s['steps']} x {cfg['batch_size']} windows of "
        f"{cfg['seq_len']} tokens ({s['epochs_started']} epochs started; code "
        f"repeated {cfg['code_repeat']}x per epoch) |",
        f"| training tokens | {s['train_tokens']:,} |",
        f"| optimizer | AdamW lr {cfg['lr']}, betas (0.9, 0.95), wd "
        f"{cfg['weight_decay']}, warmup {cfg['warmup_steps']} steps, cosine to "
        f"{cfg['min_lr_ratio']} x lr, clip {cfg['grad_clip']} |",
        f"| hardware | CPU, torch threads {cfg['num_threads']} (2-core machine "
        f"shared with other jobs; torch {s.get('torch', '?')}, transformers "
        f"{s.get('transformers', '?')}) |",
        f"| wall time | {s['train_wall_s'] / 60:.1f} min training loop "
        f"({s['tokens_per_s']:.0f} tokens/s), {s['total_wall_s'] / 60:.1f} min "
        "with data encoding and saving |",
        f"| final train loss | {s['final_train_loss']:.3f} (mean of the last 20 "
        "steps, all tokens) |",
        f"| final val loss (all tokens) | prose {val['prose']:.3f}, math "
        f"{val['math']:.3f}, code {val['code']:.3f} |",
        f"| final val loss (response tokens) | prose {val['prose_response']:.3f}, "
        f"math {val['math_response']:.3f}, code {val['code_response']:.3f} |",
        "",
        f"## Samples (greedy, temperature 0, {samples['engine']})",
        "",
        "Prompts are the first short held-out prompts of each `prompts_*.jsonl`,",
        "wrapped in the chat template; outputs are cut at 128 tokens.",
        "",
    ]
    for domain, rows in samples["samples"].items():
        lines += [f"### {domain}", ""]
        for i, row in enumerate(rows, 1):
            lines += [f"**Prompt {i}**", "", _fence(row["prompt"]), ""]
            lines += ["**Output**", "", _fence(row["output"]), ""]
    lines += [
        "## Limitations",
        "",
        "Tiny and trained for about half an hour on one CPU core (about 4 passes",
        "over under 1 M tokens of data; the validation loss was still falling): it",
        "imitates the surface of each domain (worked solutions with `<<a*b=c>>`",
        "notes and `#### N`, `def` functions in MBPP's style, English prose",
        "continuations), but its arithmetic, code and facts are wrong, and greedy",
        "decoding soon repeats a phrase. A longer run on a free machine, e.g.",
        "`--set num_threads=2 time_budget_s=7200 max_steps=4000`, should help.",
        f"Quality beyond {cfg['seq_len']} tokens of context is untested.",
        "",
    ]
    return "\n".join(lines)


def write_card(target_dir: Path) -> Path:
    path = target_dir / "README.md"
    path.write_text(render_card(target_dir), encoding="utf-8")
    return path
