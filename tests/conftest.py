"""Session fixtures: tiny models built once, bounded KV memory, seeds.

The environment is set before anything imports vLLM or Triton: `@triton.jit` reads
TRITON_INTERPRET when it decorates, and vLLM reads its env vars at import.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU in tests
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import TinyModels, build_tiny_models  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    """Tiny target, random drafter and a drafter trained on the target's outputs."""
    return build_tiny_models(Path(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_head_drafter(tiny) -> Path:
    """The trained tiny drafter plus a length head trained on its acceptance
    (a survival head reading the previous round, as new heads do)."""
    from adaflash_vllm.proposers.length_head import CONFIG_KEY, HISTORY_KEY, KIND_KEY
    from adaflash_vllm.training.checkpoint import load_drafter, save_drafter
    from adaflash_vllm.training.drafter import DFlashDrafter
    from adaflash_vllm.training.features import TargetModel
    from adaflash_vllm.training.head import train_length_head

    cfg, state = load_drafter(tiny.drafter_trained)
    cfg["dflash_config"][CONFIG_KEY] = 32
    cfg["dflash_config"][KIND_KEY] = "survival"
    cfg["dflash_config"][HISTORY_KEY] = True
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, strict=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_length_head(
            drafter.length_head,
            drafter,
            TargetModel(tiny.target),
            tiny.sequences,
            num_drafts=3,
            epochs=6,
            lr=3e-3,
        )
    finally:
        torch.set_num_threads(threads)
    return save_drafter(tiny.root / "drafter-head", cfg, drafter.state_dict())
