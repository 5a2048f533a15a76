"""Exceptions a user can cause, each naming the problem and the fix."""


class AdaFlashError(Exception):
    """Base class of every error AdaFlash raises on purpose."""


class AdaFlashConfigError(AdaFlashError, ValueError):
    """adaflash.json (or the drafter it points at) is wrong; the message says how."""


class DrafterMismatchError(AdaFlashConfigError):
    """The drafter checkpoint does not fit the target model."""


class PatchGuardError(AdaFlashError, RuntimeError):
    """A vLLM internal we patch changed shape: this vLLM is not the pinned one."""
