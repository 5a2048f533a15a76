"""Benchmark workloads: prompt sets, the domain-shift stream, the concurrency sweep.

A prompt set is a bundled name (`prose`, `math`, `code`: the demo's held-out
prompts in examples/demo/data/) or any JSONL file with a `prompt` field (and
optionally `history`, the conversation before it: training/data.py). Prompts are
wrapped in the target's chat template and taken in file order (seeded shuffle when
asked), so every configuration in a run sees the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from adaflash_vllm.errors import AdaFlashConfigError
from adaflash_vllm.training.data import chat_prompts, load_prompts

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_DATA = REPO_ROOT / "examples" / "demo" / "data"
BUNDLED_SETS = {
    "prose": "prompts_prose.jsonl",
    "math": "prompts_math.jsonl",
    "code": "prompts_code.jsonl",
    # for long phases without repeats: math+gsm8k_more+gsm8k_train (2,319 GSM8K
    # prompts the target never saw), code+mbpp_more (all 974 MBPP prompts)
    "gsm8k_more": "gsm8k_more_prompts.jsonl",
    "gsm8k_train": "gsm8k_train_prompts.jsonl",
    "mbpp_more": "mbpp_more_prompts.jsonl",
}


def prompt_set_path(name: str) -> Path:
    if name in BUNDLED_SETS:
        return BUNDLED_DATA / BUNDLED_SETS[name]
    return Path(name)


@dataclass
class Phase:
    name: str
    prompts: list[str]  # chat-templated, ready for the engine
    skipped: int = 0  # prompts of the set left out as too long for the engine
    repeated: int = 0  # requests whose prompt came earlier in the phase


@dataclass
class Workload:
    """`shift`: phases served in order, reported per window of requests.
    `sweep`: one prompt list served at each concurrency."""

    kind: str  # "shift" | "sweep"
    phases: list[Phase]
    window: int = 16  # shift: requests per reported window
    concurrencies: tuple[int, ...] = (1, 4, 16, 32, 64)
    max_tokens: int = 128
    temperature: float = 0.0
    # sweep: requests sent per concurrency slot at each level (None: 2 served, 4
    # offline). More amortise the drain at the end of each pass, where the batch
    # shrinks as the last requests finish; with drafts they finish apart.
    requests_per_slot: int | None = None
    # served sweep and shift: each request's output length drawn (seeded, the same
    # for every configuration) from max_tokens * [1 - spread, 1 + spread]; 0: all
    # max_tokens, and then a batch without drafts runs in lockstep (every request
    # starts and ends at the same step), which no served traffic does
    output_len_spread: float = 0.0
    # shift: queue the whole stream and keep `window` requests in flight, each
    # finished one replaced from the queue (`bench/refill.py`); False: each
    # window of `window` requests is one closed batch, and the next starts when
    # its last request ends
    refill: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}:" + "+".join(p.name for p in self.phases)


def load_phase(
    name: str,
    tokenizer,
    *,
    count: int,
    offset: int = 0,
    seed: int | None = None,
    max_prompt_tokens: int | None = None,
) -> Phase:
    """`count` prompts of set `name` (after `offset`), chat-templated.

    `name` may join sets with `+`: their prompts in that order. A stream longer
    than the set cycles it (how many requests repeat a prompt is in
    `Phase.repeated`).

    With `max_prompt_tokens`, prompts longer than that (templated, in tokens) are
    left out first, so that no request of the stream is one the engine must refuse
    (prompt + output over the context length); how many is in `Phase.skipped`.
    """
    records = [
        r for part in name.split("+") for r in load_prompts(prompt_set_path(part))
    ]
    if seed is not None:
        random.Random(seed).shuffle(records)
    texts = chat_prompts(tokenizer, records)  # (with any `history`)
    if max_prompt_tokens is not None:
        fits = [t for t in texts if len(tokenizer(t).input_ids) <= max_prompt_tokens]
        skipped, texts = len(texts) - len(fits), fits
        if not texts:
            raise AdaFlashConfigError(
                f"prompt set {name}: no prompt fits in {max_prompt_tokens} tokens"
            )
    else:
        skipped = 0
    chosen = texts[offset : offset + count]
    if len(chosen) < count:  # cycle small sets rather than fail a long stream
        chosen = (texts * (count // max(1, len(texts)) + 2))[offset : offset + count]
    repeated = len(chosen) - len(set(chosen))
    return Phase(_label(name), chosen, skipped, repeated)


def _label(name: str) -> str:
    return "+".join(
        part if part in BUNDLED_SETS else Path(part).stem for part in name.split("+")
    )


def parse_phase(spec: str, default_count: int) -> tuple[str, int]:
    """`SET[+SET...][:COUNT]` -> (sets, count): one phase of a `shift` stream.

    `+` serves several sets one after the other as one phase (e.g. two prompt
    files of one domain, for a long phase without repeats); `:COUNT` overrides
    `--per-phase` for this phase.
    """
    name, sep, count = spec.rpartition(":")
    if not sep or not count.isdigit():
        return spec, default_count
    if not name or int(count) < 1:
        raise AdaFlashConfigError(f"phase {spec!r}: expected SET[:COUNT], COUNT >= 1")
    return name, int(count)


def check_output_len_spread(spread: float) -> None:
    if not 0.0 <= spread < 1.0:
        raise AdaFlashConfigError(
            f"output length spread (--output-len-spread) must be in [0, 1), "
            f"got {spread}"
        )


def longest_output(max_tokens: int, spread: float = 0.0) -> int:
    """The longest output `output_lengths` can draw (prompts must leave room)."""
    return max(1, round(max_tokens * (1.0 + spread)))


def seeded_lengths(num: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """`num` lengths drawn uniformly from [lo, hi] with their own seeded stream."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(num)]


def output_lengths(
    num: int, max_tokens: int, spread: float = 0.0, seed: int = 0
) -> list[int]:
    """`num` output lengths: all `max_tokens`, or with `spread` in (0, 1) drawn
    uniformly (seeded) from [max_tokens (1 - spread), max_tokens (1 + spread)]."""
    check_output_len_spread(spread)
    if spread == 0.0:
        return [max_tokens] * num
    lo = max(1, round(max_tokens * (1.0 - spread)))
    hi = max(lo, longest_output(max_tokens, spread))
    return seeded_lengths(num, lo, hi, seed)
