"""The z-lab DFlash checkpoint format: config.json + model.safetensors, no embed.

Every engine reads this format (vLLM `method: "dflash"`, SGLang, the z-lab HF code):
`architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"` and a `dflash_config` with
`mask_token_id` and `target_layer_ids` (0-based target decoder layers; the drafter
reads the residual stream *after* each). The drafter shares the target's
`embed_tokens` and `lm_head`, so neither is ever written here.

Shape symbols: H hidden, I intermediate, NH query heads, NKV kv heads, HD head dim,
L draft layers, T number of target layers tapped.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
HEAD_PREFIX = "length_head."
HEAD_FILE = "length_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARED_WITH_TARGET = ("embed_tokens", "lm_head")
"""Name fragments of tensors the drafter borrows from the target: never saved."""


def drafter_config(
    *,
    target_config: dict[str, Any],
    num_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    block_size: int,
    intermediate_size: int | None = None,
    extra_dflash: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A DFlash drafter config.json for `target_config` (the target's config.json).

    Attention shapes, vocabulary, RoPE and norms follow the target, as in z-lab's
    released drafters.
    """
    t = target_config
    hidden = t["hidden_size"]
    rope = t.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": t.get("rope_theta", 1_000_000.0),
    }
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "head_dim": t.get("head_dim", hidden // t["num_attention_heads"]),
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or t["intermediate_size"],
        "vocab_size": t["vocab_size"],
        "hidden_act": t.get("hidden_act", "silu"),
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 4096),
        "attention_bias": False,
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "dtype": t.get("dtype") or t.get("torch_dtype") or "float32",
        "block_size": block_size,
        "num_target_layers": t["num_hidden_layers"],
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            **(extra_dflash or {}),
        },
    }
    return cfg


def random_drafter_state(
    cfg: dict[str, Any], *, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Randomly initialised drafter tensors in checkpoint names (norms at one)."""
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]  # noqa: E741
    NH, NKV, HD = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    T = len(cfg["dflash_config"]["target_layer_ids"])

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rnd(NH * HD, H)
        sd[p + "self_attn.k_proj.weight"] = rnd(NKV * HD, H)
        sd[p + "self_attn.v_proj.weight"] = rnd(NKV * HD, H)
        sd[p + "self_attn.o_proj.weight"] = rnd(H, NH * HD)
        sd[p + "self_attn.q_norm.weight"] = torch.ones(HD)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(HD)
        sd[p + "mlp.gate_proj.weight"] = rnd(I, H)
        sd[p + "mlp.up_proj.weight"] = rnd(I, H)
        sd[p + "mlp.down_proj.weight"] = rnd(H, I)
        sd[p + "input_layernorm.weight"] = torch.ones(H)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H)
    sd["norm.weight"] = torch.ones(H)
    sd["hidden_norm.weight"] = torch.ones(H)
    sd["fc.weight"] = rnd(H, H * T)
    return sd


def save_drafter(
    out_dir: str | os.PathLike,
    cfg: dict[str, Any],
    state: dict[str, torch.Tensor],
    *,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write a drafter checkpoint atomically (a crash never leaves a torn folder).

    Tensors named like the target's shared modules are refused: writing them would
    make vLLM load a private copy instead of sharing the target's.
    """
    shared = [
        k
        for k in state
        if any(k.startswith(s) or f".{s}" in k for s in SHARED_WITH_TARGET)
    ]
    if shared:
        raise ValueError(f"drafter state holds target-owned tensors: {shared}")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tensors = {
        k: v.detach().to("cpu").contiguous()
        for k, v in state.items()
        if not k.startswith(HEAD_PREFIX)
    }
    head = {
        k: v.detach().to("cpu").contiguous()
        for k, v in state.items()
        if k.startswith(HEAD_PREFIX)
    }
    save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    if head:  # beside the drafter, hidden from stock vLLM by the weight index
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        (tmp / INDEX_FILE).write_text(
            json.dumps(
                {
                    "metadata": {},
                    "weight_map": dict.fromkeys(sorted(tensors), WEIGHTS_NAME),
                },
                indent=1,
            )
        )
    (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    for name, data in (extra_files or {}).items():
        (tmp / name).write_bytes(data)
    tmp.chmod(0o755)  # mkdtemp makes it private; checkpoints are meant to be shared
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        if old.exists():
            _rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        _rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def load_drafter(
    path: str | os.PathLike,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read (config, state) of a drafter checkpoint folder."""
    path = Path(path)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    state = load_file(str(path / WEIGHTS_NAME))
    if (path / HEAD_FILE).exists():
        state.update(load_file(str(path / HEAD_FILE)))
    return cfg, state


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
