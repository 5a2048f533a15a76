"""Tokenizer and target stages of the demo build: a BPE tokenizer and a small Qwen3.

The tokenizer is a byte-level BPE trained on the prompt and response text of
data/train_target.jsonl, with the special tokens and chat template of
adaflash_vllm.tiny. The target is a Qwen3ForCausalLM trained from scratch on CPU.

Run: `python examples/demo/build_demo.py --stage tokenizer` or `--stage target`
(see build_demo.py --help).

Training recipe (all seeded):
  * documents: chat template with the user prompt, then the assistant response,
    `<|im_end|>\\n` and the eos `<|endoftext|>`; prompt and response are tokenized
    separately so the prompt tokens are exactly what an engine sees at inference.
  * packing: per epoch, the documents of each domain are shuffled and concatenated
    into one stream, cut into SEQ_LEN windows (a window can hold several documents
    of one domain, and a document can straddle two windows). Windows of all domains
    are then shuffled. A domain-pure window teaches the model to continue in the
    same domain after an eos, which keeps `ignore_eos` benchmark streams in domain.
    Code documents are repeated `code_repeat` times per epoch (MBPP is small).
  * loss: next-token cross-entropy on every token (prompts included, which gives
    the small model more language to learn from); the validation loss is also
    reported on response tokens only.
  * AdamW, linear warmup then cosine decay to `min_lr_ratio`. The schedule's
    progress is max(step / max_steps, elapsed / time_budget_s), so the run ends on
    time even when the machine is shared and slower than when it was sized.
  * bf16 autocast for the forward pass (fp32 master weights); weights are saved as
    bf16 safetensors (config dtype bfloat16; vLLM loads them with dtype=float32).
  * one torch thread by default: on the shared 2-core build machine, 2 threads ran
    5x slower than 1 (329 vs 1769 tokens/s) while another job held a core,
    because OpenMP threads wait for each other. On an idle machine 2 threads gave
    ~2600 tokens/s in a probe: use `--set num_threads=2` there.

Shape symbols: B batch (windows), T window length (SEQ_LEN), V vocabulary.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

if TYPE_CHECKING:
    from transformers import (
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

Window = tuple[torch.Tensor, torch.Tensor]  # ids [T], response mask [T]
Doc = tuple[list[int], list[int]]  # token ids, response mask

EOS = "<|endoftext|>"
END_OF_TURN = "<|im_end|>"
DOMAINS = ("prose", "math", "code")


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """Model shape and training recipe of the demo target."""

    vocab_size: int = 4096  # tokenizer vocabulary, special tokens included
    num_layers: int = 6
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32  # vLLM's CPU attention needs >= 32
    intermediate_size: int = 768
    max_position_embeddings: int = 2048  # trained on seq_len windows only
    seq_len: int = 512
    batch_size: int = 8  # windows per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 900
    time_budget_s: float = 1740.0  # training loop wall clock, evals included
    val_fraction: float = 0.02  # of each domain's documents
    eval_every: int = 100
    code_repeat: int = 2
    num_threads: int = 1  # see the module docstring
    seed: int = 0


def load_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build_tokenizer(
    train_path: Path, out_dir: Path, vocab_size: int
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on train_target text and save it (HF format).

    Returns the `PreTrainedTokenizerFast`; its chat template is tiny.CHAT_TEMPLATE.
    """
    from adaflash_vllm.tiny import build_tokenizer as train_bpe

    records = load_jsonl(train_path)
    texts = (r["prompt"] + "\n" + r.get("response", "") for r in records)
    return train_bpe(out_dir, vocab_size, texts, show_progress=True)


def chat_prefix(tok: PreTrainedTokenizerBase, prompt: str) -> str:
    """The templated user turn plus the assistant header, as an engine sees it."""
    return tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=False,
    )


def encode_docs(tok: PreTrainedTokenizerBase, records: list[dict]) -> list[Doc]:
    """(token ids, response mask) per record; mask is 1 on response tokens."""
    prefixes = [chat_prefix(tok, r["prompt"]) for r in records]
    responses = [r["response"] + END_OF_TURN + "\n" + EOS for r in records]
    p_ids = tok(prefixes, add_special_tokens=False)["input_ids"]
    r_ids = tok(responses, add_special_tokens=False)["input_ids"]
    return [
        (p + r, [0] * len(p) + [1] * len(r)) for p, r in zip(p_ids, r_ids, strict=True)
    ]


def _pack(docs: list[Doc], seq_len: int, rng: random.Random) -> list[Window]:
    """Shuffle, concatenate and cut into [T] windows of ids and response mask."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    ids = [t for i in order for t in docs[i][0]]
    mask = [m for i in order for m in docs[i][1]]
    n = len(ids) // seq_len
    ids_t = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    mask_t = torch.tensor(mask[: n * seq_len]).view(n, seq_len)
    return list(zip(ids_t, mask_t, strict=True))


def _token_losses(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """Per-token next-token loss, [B, T-1] (fp32), bf16 autocast forward."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits  # [B, T, V]
    b, t = ids.shape
    flat = logits[:, :-1].reshape(b * (t - 1), -1).float()
    return F.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none").view(
        b, t - 1
    )


@torch.no_grad()
def evaluate(
    model: PreTrainedModel, val: dict[str, list[Window]], batch_size: int
) -> dict[str, float]:
    """Mean loss per domain on all tokens (`<d>`) and on response tokens."""
    model.eval()
    out = {}
    for domain, windows in val.items():
        tot = resp = n_tot = n_resp = 0.0
        for i in range(0, len(windows), batch_size):
            ids = torch.stack([w[0] for w in windows[i : i + batch_size]])
            mask = torch.stack([w[1] for w in windows[i : i + batch_size]])[:, 1:]
            loss = _token_losses(model, ids)
            tot, n_tot = tot + loss.sum().item(), n_tot + loss.numel()
            resp += (loss * mask).sum().item()
            n_resp += mask.sum().item()
        out[domain] = tot / max(1, n_tot)
        out[f"{domain}_response"] = resp / max(1, n_resp)
    out["all"] = sum(out[d] for d in val) / len(val)
    model.train()
    return out


def _lr_at(cfg: TargetConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def make_model(cfg: TargetConfig, tok: PreTrainedTokenizerBase) -> PreTrainedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos_id = tok.convert_tokens_to_ids(EOS)
    qcfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=eos_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(qcfg)


def _split(
    records: list[dict], cfg: TargetConfig, tok: PreTrainedTokenizerBase
) -> tuple[dict[str, list[Doc]], dict[str, list[Doc]]]:
    """Encoded train and val documents per domain (val: a seeded fraction)."""
    rng = random.Random(cfg.seed)
    train, val = defaultdict(list), defaultdict(list)
    for domain in DOMAINS:
        rows = [r for r in records if r["domain"] == domain]
        docs = encode_docs(tok, rows)
        idx = list(range(len(docs)))
        rng.shuffle(idx)
        n_val = max(16, int(len(docs) * cfg.val_fraction))
        val[domain] = [docs[i] for i in idx[:n_val]]
        train[domain] = [docs[i] for i in idx[n_val:]]
    return train, val


def train_target(
    *, train_path: Path, tok_dir: Path, out_dir: Path, cfg: TargetConfig
) -> dict:
    """Train the target, save it to `out_dir` (HF folder) and return a summary."""
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    train, val_docs = _split(load_jsonl(train_path), cfg, tok)
    rng = random.Random(cfg.seed + 1)
    val = {d: _pack(val_docs[d], cfg.seq_len, rng) for d in DOMAINS}
    model = make_model(cfg, tok)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    windows: list[Window] = []
    step, tokens, epoch, history = 0, 0, 0, []
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, desc="target", mininterval=5.0)
    while True:
        progress = max(
            step / cfg.max_steps, (time.perf_counter() - t0) / cfg.time_budget_s
        )
        if progress >= 1.0:
            break
        if len(windows) < cfg.batch_size:  # new epoch: re-shuffle and re-pack
            windows = []
            for d in DOMAINS:
                reps = cfg.code_repeat if d == "code" else 1
                windows += _pack(train[d] * reps, cfg.seq_len, rng)
            rng.shuffle(windows)
            epoch += 1
        batch, windows = windows[: cfg.batch_size], windows[cfg.batch_size :]
        ids = torch.stack([w[0] for w in batch])  # [B, T]
        lr = _lr_at(cfg, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _token_losses(model, ids).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + ids.numel()
        elapsed = time.perf_counter() - t0
        history.append({"step": step, "loss": loss.item(), "lr": lr})
        bar.update(1)
        bar.set_postfix(
            loss=f"{loss.item():.3f}", tok_s=f"{tokens / elapsed:.0f}", ep=epoch
        )
        if step % cfg.eval_every == 0:
            ev = evaluate(model, val, cfg.batch_size)
            history[-1]["val"] = ev
            tqdm.write(
                f"step {step} epoch {epoch} {elapsed:.0f}s lr {lr:.2e} train "
                f"{loss.item():.3f} val "
                + " ".join(f"{k} {v:.3f}" for k, v in ev.items())
            )
    bar.close()
    train_wall = time.perf_counter() - t0
    final_val = evaluate(model, val, cfg.batch_size)
    last = history[-20:]
    summary = {
        "config": asdict(cfg),
        "steps": step,
        "epochs_started": epoch,
        "train_tokens": tokens,
        "train_docs": {d: len(train[d]) for d in DOMAINS},
        "val_docs": {d: len(val_docs[d]) for d in DOMAINS},
        "val_tokens": sum(len(v) * cfg.seq_len for v in val.values()),
        "train_wall_s": round(train_wall, 1),
        "tokens_per_s": round(tokens / train_wall, 1),
        "final_train_loss": sum(h["loss"] for h in last) / len(last),
        "final_val": final_val,
        "num_params": sum(p.numel() for p in model.parameters()),
        "history": [h for h in history if "val" in h or h["step"] % 10 == 0],
    }
    _save(model, tok, out_dir)
    summary["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    return summary


def _save(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out_dir: Path) -> None:
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    eos_id = tok.convert_tokens_to_ids(EOS)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[tok.convert_tokens_to_ids(END_OF_TURN), eos_id],
        pad_token_id=eos_id,
    )
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


@torch.no_grad()
def hf_samples(
    target_dir: Path, prompts: dict[str, list[str]], max_new_tokens: int = 128
) -> dict[str, list[dict]]:
    """Greedy generations with transformers (fp32), per domain."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.eval()
    out = {}
    for domain, plist in prompts.items():
        out[domain] = []
        for prompt in plist:
            ids = tok(chat_prefix(tok, prompt), return_tensors="pt")["input_ids"]
            gen = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
            )
            text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            out[domain].append({"prompt": prompt, "output": text})
    return out
