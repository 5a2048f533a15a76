"""The AdaFlash drafter model in vLLM: DFlash (`DFlashQwen3ForCausalLM`) plus the
length head and the bookkeeping AdaFlash needs (weight version).

It loads plain z-lab DFlash checkpoints unchanged; a checkpoint whose
`dflash_config` names a length head (`thresh_head_bottleneck_dim`) also gets
`length_head.safetensors` loaded. vLLM's proposer asserts the drafter is a
`DFlashQwen3ForCausalLM`, hence a subclass rather than a wrapper.
"""

from __future__ import annotations

from pathlib import Path

import torch
from adaflash_vllm.proposers.length_head import (
    LengthHead,
    head_config,
    load_length_head,
)
from vllm.logger import init_logger
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

logger = init_logger(__name__)

ADAFLASH_ARCH = "DFlashAdaFlashDraftModel"
"""Registry name; `DFlash` prefix so vLLM's EAGLEConfig keeps it as is."""


class AdaFlashDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """DFlash drafter with an optional length head and a weight version
    (0 = the checkpoint it started from)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.drafter_version = 0
        cfg = self.config.to_dict() if hasattr(self.config, "to_dict") else {}
        cfg.setdefault("dflash_config", getattr(self.config, "dflash_config", {}))
        bottleneck = head_config(cfg)
        self.length_head: LengthHead | None = (
            LengthHead(self.config.hidden_size, bottleneck).float()
            if bottleneck
            else None
        )

    def load_weights(self, weights):
        result = super().load_weights(weights)
        if self.length_head is not None:
            self._load_length_head()
        return result

    def _load_length_head(self) -> None:
        folder = Path(self.draft_model_config.model)
        head = load_length_head(
            folder,
            {
                "hidden_size": self.config.hidden_size,
                "dflash_config": self.config.dflash_config,
            },
        )
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
            "AdaFlash: loaded length head (bottleneck %d) from %s",
            head.bottleneck,
            folder,
        )
