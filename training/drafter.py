"""The DFlash drafter in plain torch, computing exactly what vLLM's DFlash computes.

vLLM (`qwen3_dflash.py`) drafts one block per request: queries
`[bonus, MASK x K]` at positions `a .. a+K`, attending non-causally to each other
and to context K/V injected from the target for every earlier position `< a`:

    ctx_p = fc(concat_l h_l[p])        # h_l: target residual after layer l
    k_p^i = rope(k_norm^i(k_proj^i(rms(ctx_p; hidden_norm))), p)   # draft layer i
    v_p^i = v_proj^i(rms(ctx_p; hidden_norm))

Queries run through ordinary Qwen3 decoder layers (pre-norm, q/k norms, RoPE at the
block positions) and a final `norm`; logits use the target's `lm_head` (shared, not
owned). Training runs many blocks per sequence in one forward: block j sees context
`< a_j` and its own K+1 tokens, nothing else (a block-diagonal mask over anchors).

Parameter names equal the z-lab checkpoint names, so `state_dict()` is the checkpoint.

Shape symbols: B sequences, N tokens per sequence, M blocks (anchors) per sequence,
S = K + 1 tokens per block, H hidden, T target layers tapped, NH/NKV heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (`forward_native`): normalise in fp32, scale in input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.weight


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [*, D/2] for neox-style RoPE, computed in fp32 like vLLM's cache."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [..., D] by (cos, sin) [..., D/2] broadcast over heads."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.d = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            d,
        )
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(h, self.nh * d, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=bias)
        self.o_proj = nn.Linear(self.nh * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(d, cfg["rms_norm_eps"])

    def context_kv(
        self, ctx_normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [B, NKV, N, D] of the injected context (ctx_normed: [B, N, H])."""
        b, n, _ = ctx_normed.shape
        k = self.k_norm(self.k_proj(ctx_normed).view(b, n, self.nkv, self.d))
        v = self.v_proj(ctx_normed).view(b, n, self.nkv, self.d)
        k = apply_rope(k, cos.unsqueeze(2), sin.unsqueeze(2))
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] block tokens (all blocks, flattened)
        cos: torch.Tensor,  # [B, Q, D/2] at the block positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [B, NKV, N, D]
        ctx_v: torch.Tensor,
        mask: torch.Tensor,  # [B, 1, Q, N + Q] bool, True = may attend
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.d))
        k = self.k_norm(self.k_proj(x).view(b, q_len, self.nkv, self.d))
        v = self.v_proj(x).view(b, q_len, self.nkv, self.d)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
        k = apply_rope(k, cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v.transpose(1, 2)], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.nh != self.nkv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.nh * self.d))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Training-side DFlash drafter; `state_dict()` is a z-lab checkpoint.

    Args:
        cfg: the drafter's config.json as a dict (see `checkpoint.drafter_config`).

    Example:
        >>> drafter = DFlashDrafter(cfg)
        >>> hidden = drafter(features=f, block_ids=ids, block_positions=pos,
        ...                  anchors=a, embed_tokens=target.get_input_embeddings())
    """

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.cfg = cfg
        dflash = cfg.get("dflash_config", {})
        if dflash.get("causal") or cfg.get("is_causal") or cfg.get("layer_types"):
            raise NotImplementedError(
                "causal / sliding-window DFlash drafters are not supported by the "
                "AdaFlash trainer yet (the z-lab format default is non-causal)"
            )
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = list(dflash["target_layer_ids"])
        h = cfg["hidden_size"]
        self.head_dim = cfg["head_dim"]
        rope = cfg.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e6)))
        self.layers = nn.ModuleList(
            DrafterLayer(cfg) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        target_hidden = cfg.get("target_hidden_size") or h
        self.fc = nn.Linear(target_hidden * len(self.target_layer_ids), h, bias=False)
        from adaflash_vllm.proposers.length_head import make_length_head

        self.length_head = make_length_head(cfg)

    @property
    def block_size(self) -> int:
        return int(self.cfg.get("block_size", 16))

    def forward(
        self,
        *,
        features: torch.Tensor,  # [B, N, T*H] target residuals at every position
        block_ids: torch.Tensor,  # [B, M, S] first id = the anchor's token, then masks
        block_positions: torch.Tensor,  # [B, M, S] = anchor + (0..K)
        anchors: torch.Tensor,  # [B, M] block j sees context positions < anchors[:, j]
        embed_tokens: nn.Module,  # the target's (frozen) input embedding
        context_valid: torch.Tensor | None = None,  # [B, N] bool, False = padding
    ) -> torch.Tensor:
        """Hidden states [B, M, S, H] after the final norm (logits = lm_head(.))."""
        b, n, _ = features.shape
        _, m, s = block_ids.shape
        ctx = self.hidden_norm(self.fc(features))
        ctx_pos = torch.arange(n, device=features.device).expand(b, n)
        c_cos, c_sin = rope_cos_sin(ctx_pos, self.head_dim, self.rope_theta)
        q_pos = block_positions.reshape(b, m * s)
        q_cos, q_sin = rope_cos_sin(q_pos, self.head_dim, self.rope_theta)
        mask = self._block_mask(anchors, n, s, context_valid)
        x = embed_tokens(block_ids.reshape(b, m * s)).to(self.fc.weight.dtype)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, c_cos, c_sin)
            x = layer(x, q_cos, q_sin, ctx_k, ctx_v, mask)
        return self.norm(x).view(b, m, s, -1)

    @staticmethod
    def _block_mask(
        anchors: torch.Tensor, n: int, s: int, context_valid: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, 1, M*S, N + M*S]: context p visible iff p < anchor; blocks see only
        themselves (all S tokens, non-causal)."""
        b, m = anchors.shape
        device = anchors.device
        pos = torch.arange(n, device=device)
        ctx_ok = pos.view(1, 1, n) < anchors.unsqueeze(-1)  # [B, M, N]
        if context_valid is not None:
            ctx_ok = ctx_ok & context_valid.unsqueeze(1)
        ctx_ok = ctx_ok.repeat_interleave(s, dim=1)  # [B, M*S, N]
        blk = torch.arange(m, device=device).repeat_interleave(s)
        same = (blk.view(-1, 1) == blk.view(1, -1)).expand(b, -1, -1)  # [B, M*S, M*S]
        return torch.cat([ctx_ok, same], dim=-1).unsqueeze(1)

    def make_blocks(
        self, input_ids: torch.Tensor, anchors: torch.Tensor, num_drafts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and positions [B, M, K+1] for anchors [B, M] into input_ids [B, N].

        The anchor token is the last known token (vLLM's "bonus"); the K slots after
        it are mask tokens.
        """
        b, m = anchors.shape
        s = num_drafts + 1
        first = torch.gather(input_ids, 1, anchors.clamp(max=input_ids.shape[1] - 1))
        ids = torch.full(
            (b, m, s),
            self.mask_token_id,
            dtype=input_ids.dtype,
            device=input_ids.device,
        )
        ids[:, :, 0] = first
        positions = anchors.unsqueeze(-1) + torch.arange(s, device=anchors.device)
        return ids, positions
