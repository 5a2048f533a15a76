"""Prompt sets and target-regenerated training sequences.

A prompt file is JSONL with a `prompt` field per line (the project's bundled sets
and `../shared/data` use this schema). A line may also carry `history`: the
conversation before `prompt`, as chat messages (`{"role": "user" | "assistant" |
"system", "content": str}`), so that a set can hold follow-up turns
(`examples/second_turns.py` writes one); `prompt` is then the last user turn.

Training sequences are the target's own responses (greedy by default) under its
chat template, as in the DFlash recipe: the drafter learns what the target says,
not what a dataset says.
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
            problem = _history_problem(rec.get("history"))
            if problem:
                raise AdaFlashConfigError(f"{path}:{lineno}: `history` {problem}")
            records.append(rec)
    if not records:
        raise AdaFlashConfigError(f"prompt file {path} has no prompts")
    if shuffle:
        random.Random(seed).shuffle(records)
    return records[:limit] if limit else records


CHAT_ROLES = ("system", "user", "assistant")


def _history_problem(history) -> str | None:
    """What is wrong with a record's `history` (None: absent or well formed)."""
    if history is None:
        return None
    if not isinstance(history, list):
        return f"must be a list of chat messages, got {type(history).__name__}"
    for i, m in enumerate(history):
        if (
            not isinstance(m, dict)
            or m.get("role") not in CHAT_ROLES
            or not isinstance(m.get("content"), str)
        ):
            return (
                f"message {i} must be {{'role': one of {list(CHAT_ROLES)}, "
                f"'content': str}}, got {m!r:.80}"
            )
    return None


def chat_messages(prompt: str | dict) -> list[dict]:
    """A prompt (a user turn) or a prompt record (`prompt`, optional `history`)
    as the chat messages that end with it."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    history = [
        {"role": m["role"], "content": m["content"]} for m in prompt.get("history", ())
    ]
    return [*history, {"role": "user", "content": prompt["prompt"]}]


def chat_prompts(tokenizer, prompts: list[str | dict]) -> list[str]:
    """Wrap user prompts in the target's chat template (generation prompt added).
    An item may be a prompt record: its `history` comes before the prompt. A
    tokenizer without a template gets the messages' contents, one per line."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ["\n".join(m["content"] for m in chat_messages(p)) for p in prompts]
    return [
        tokenizer.apply_chat_template(
            chat_messages(p), tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def regenerate(
    llm,
    prompts: list[str | dict],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    domains: list[str] | None = None,
    seed: int = 0,
) -> list[Sequence]:
    """Let the target answer `prompts` (chat template applied; prompt records
    keep their `history`) through vLLM."""
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
