"""The AdaFlash drafter model in vLLM: DFlash (`DFlashQwen3ForCausalLM`) plus the
bookkeeping AdaFlash needs (weight version).

It loads plain z-lab DFlash checkpoints unchanged. vLLM's proposer asserts the
drafter is a `DFlashQwen3ForCausalLM`, hence a subclass rather than a wrapper.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

ADAFLASH_ARCH = "DFlashAdaFlashDraftModel"
"""Registry name; `DFlash` prefix so vLLM's EAGLEConfig keeps it as is."""


class AdaFlashDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """DFlash drafter with a weight version (0 = the checkpoint it started from)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.drafter_version = 0
