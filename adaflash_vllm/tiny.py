"""Tiny models built in seconds: a Qwen3 target, its BPE tokenizer, a DFlash drafter.

Used by the tests (session fixtures) and by `adaflash make-tiny`. CPU attention in
vLLM needs head_dim >= 32, so the target uses 32.

Run: `adaflash make-tiny OUT_DIR` writes OUT_DIR/target and OUT_DIR/drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adaflash_vllm.training.checkpoint import (
    drafter_config,
    random_drafter_state,
    save_drafter,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "once upon a time there was a small cat who liked to read books.",
    "question: what is 12 plus 30? answer: 12 + 30 = 42.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "speculative decoding drafts tokens and the target verifies them.",
    "hello world, this is a tiny model for tests. 0 1 2 3 4 5 6 7 8 9",
]


def build_tokenizer(
    out_dir: Path, vocab_size: int, corpus=None, *, show_progress: bool = False
):
    """Train a byte-level BPE (with SPECIAL_TOKENS and CHAT_TEMPLATE) on `corpus`
    (an iterable of texts; default: a small built-in one) and save it for HF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_CORPUS * 20 if corpus is None else corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def build_target(
    out_dir: str | Path,
    *,
    num_layers: int = 3,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """A random Qwen3ForCausalLM (float32, tied embeddings) plus its tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    # Larger-than-default init gives a target whose greedy text is not one token
    # repeated forever, so tests compare non-trivial sequences.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
    model.save_pretrained(out, safe_serialization=True)
    return out


def mask_token_id(target_dir: str | Path) -> int:
    tok = json.loads((Path(target_dir) / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] == "<|mask|>":
            return added["id"]
    raise KeyError("<|mask|> not in the tiny tokenizer")


def build_drafter(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    block_size: int = 4,
    seed: int = 0,
) -> Path:
    """A random z-lab-format DFlash drafter that fits the target in `target_dir`."""
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    n = target_cfg["num_hidden_layers"]
    cfg = drafter_config(
        target_config=target_cfg,
        num_layers=num_layers,
        target_layer_ids=target_layer_ids or list(range(max(1, n - 1))),
        mask_token_id=mask_token_id(target_dir),
        block_size=block_size,
    )
    return save_drafter(out_dir, cfg, random_drafter_state(cfg, seed=seed))


def build_tiny_pair(out_dir: str | Path, **drafter_kw) -> tuple[Path, Path]:
    """Build `out_dir/target` and `out_dir/drafter`; returns their paths."""
    out = Path(out_dir)
    target = build_target(out / "target")
    drafter = build_drafter(out / "drafter", target, **drafter_kw)
    return target, drafter
