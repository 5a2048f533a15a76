"""vLLM general-plugin entry point (`vllm.general_plugins` -> `adaflash`).

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once; everything here is idempotent and cheap.
"""

from __future__ import annotations

_REGISTERED = False


def register() -> None:
    """Register the AdaFlash drafter architecture and apply the engine patches."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm import ModelRegistry

    share_vllm_log_handlers()

    from adaflash_vllm import patches
    from adaflash_vllm.proposers.model import ADAFLASH_ARCH

    ModelRegistry.register_model(
        ADAFLASH_ARCH, "adaflash_vllm.proposers.model:AdaFlashDFlashForCausalLM"
    )
    patches.apply_engine_patches()
    _REGISTERED = True


def share_vllm_log_handlers(*, configure: bool = False) -> None:
    """Route `adaflash_vllm.*` logs through vLLM's handlers, format and level.

    `configure=True` (our own processes, e.g. the trainer) first applies vLLM's
    default logging configuration, which vLLM processes do themselves.
    """
    import logging

    if configure:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed

        configure_logging_if_needed(LoggingConfig())
    vllm_logger = logging.getLogger("vllm")
    ours = logging.getLogger("adaflash_vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level)
    ours.propagate = False
