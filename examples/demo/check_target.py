"""Check that the demo target loads and generates in vLLM on CPU; refresh its card.

Generates greedily (temperature 0) for the first short held-out prompts of each
domain through the chat template, prints them, counts how many equal the
transformers greedy samples written by the target stage, then stores the vLLM
samples in target/samples.json and re-renders target/README.md. One engine, about
a minute on 2 CPU cores (engine start ~40 s).

Run: VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 python examples/demo/check_target.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import demo_card

DEMO_DIR = Path(__file__).resolve().parent


def generate(target: Path, prompts: dict[str, list[str]], max_tokens: int) -> dict:
    """Greedy vLLM outputs per domain: {domain: [{prompt, output}]}."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
    )
    tok = llm.get_tokenizer()
    flat = [(d, p) for d, plist in prompts.items() for p in plist]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for _, p in flat
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(texts, params)
    samples: dict[str, list[dict]] = {d: [] for d in prompts}
    for (domain, prompt), out in zip(flat, outs, strict=True):
        samples[domain].append({"prompt": prompt, "output": out.outputs[0].text})
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", type=Path, default=DEMO_DIR / "target")
    p.add_argument("--data", type=Path, default=DEMO_DIR / "data")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-card", action="store_true", help="leave README.md as is")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    samples = generate(
        args.target, demo_card.sample_prompts(args.data), args.max_tokens
    )
    samples_path = args.target / "samples.json"
    previous = json.loads(samples_path.read_text()) if samples_path.exists() else {}
    same = total = 0
    for domain, rows in samples.items():
        print(f"\n===== {domain}")
        ref = previous.get("hf_samples", previous.get("samples", {})).get(domain, [])
        for i, row in enumerate(rows):
            print(f"--- prompt: {row['prompt']!r}\n{row['output']}")
            if i < len(ref) and ref[i]["prompt"] == row["prompt"]:
                same += ref[i]["output"] == row["output"]
                total += 1
    note = f"{same}/{total} identical to transformers greedy (fp32)"
    print(f"\nvLLM {vllm.__version__}: {note}")
    if args.no_card:
        return
    record = {
        "engine": f"vLLM {vllm.__version__} CPU, dtype float32; {note}",
        "samples": samples,
        "hf_samples": previous.get("hf_samples", previous.get("samples", {})),
    }
    samples_path.write_text(json.dumps(record, indent=1))
    print(f"wrote {demo_card.write_card(args.target)}")


if __name__ == "__main__":
    main()
