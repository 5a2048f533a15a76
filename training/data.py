"""Prompt sets and target-regenerated training sequences.

A prompt file is JSONL with a `prompt` field per line (the project's bundled sets
and `../shared/data` use this schema). Training sequences are the target's own
responses (greedy by default) under its chat template, as in the DFlash recipe:
the drafter learns what the target says, not what a dataset says.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from adaflash_vllm.errors import AdaFlashConfigError


@dataclass
class Sequence:
    """One training sequence: prompt tokens then the target's response tokens."""

    token_ids: list[int]
    prompt_len: int
    domain: str = ""


def load_prompts(
    path: str | Path, *, limit: int | None = None, seed: int = 0, shuffle: bool = False
) -> list[dict]:
    """Records of a JSONL prompt file; each has at least `prompt` (a non-empty str).

    Raises:
        AdaFlashConfigError: missing/empty file or a malformed line (with its number).
    """
    path = Path(path)
    if not path.is_file():
        raise AdaFlashConfigError(f"prompt file not found: {path}")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise AdaFlashConfigError(
                    f"{path}:{lineno}: not valid JSON ({e.msg})"
                ) from None
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("prompt"), str)
                or not rec["prompt"].strip()
            ):
                raise AdaFlashConfigError(
                    f"{path}:{lineno}: each line needs a non-empty string field "
                    "`prompt`"
                )
            records.append(rec)
    if not records:
        raise AdaFlashConfigError(f"prompt file {path} has no prompts")
    if shuffle:
        random.Random(seed).shuffle(records)
    return records[:limit] if limit else records


def chat_prompts(tokenizer, prompts: list[str]) -> list[str]:
    """Wrap user prompts in the target's chat template (generation prompt added)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return prompts
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def regenerate(
    llm,
    prompts: list[str],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    domains: list[str] | None = None,
    seed: int = 0,
) -> list[Sequence]:
    """Let the target answer `prompts` (chat template applied) through vLLM."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    texts = chat_prompts(tokenizer, prompts)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    outs = llm.generate(texts, params, use_tqdm=True)
    seqs = []
    for i, out in enumerate(outs):
        prompt = list(out.prompt_token_ids)
        seqs.append(
            Sequence(
                token_ids=prompt + list(out.outputs[0].token_ids),
                prompt_len=len(prompt),
                domain=domains[i] if domains else "",
            )
        )
    return seqs


def save_sequences(path: str | Path, seqs: list[Sequence]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for s in seqs:
            f.write(
                json.dumps(
                    {
                        "token_ids": s.token_ids,
                        "prompt_len": s.prompt_len,
                        "domain": s.domain,
                    }
                )
                + "\n"
            )
    tmp.replace(path)


def load_sequences(path: str | Path) -> list[Sequence]:
    with Path(path).open() as f:
        return [Sequence(**json.loads(line)) for line in f if line.strip()]
