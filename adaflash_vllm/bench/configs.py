"""Named benchmark configurations: what each one passes to vLLM.

Every configuration is the same target served by the same vLLM build; only the
speculative config differs. Names:

    plain             no speculation (the baseline every ratio divides by)
    dflash            stock vLLM `method: "dflash"` with the given drafter and K
    dflash_schedule   stock DFlash with `num_speculative_tokens_per_batch_size`
                      (vLLM's batch-size schedule of K)
    ngram             vLLM's prompt-lookup drafter
    adaflash          the adaflash.json given (its `adaflash` section as is)
    adaflash:MODE     the same with `adaflash.length.mode = MODE`
    NAME@PATH         the adaflash.json at PATH, reported as NAME (several AdaFlash
                      variants in one run, e.g. static@a.json,online@b.json)

The drafter and K always come from the setup, so every configuration drafts with
the same initial drafter. A configuration with `adaflash.online.enabled` gets its
own empty buffer and versions folders inside the result folder (`with_fresh_online`),
so no run resumes another's drafter.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaflash_vllm.config import read_speculative_config
from adaflash_vllm.errors import AdaFlashConfigError


@dataclass(frozen=True)
class BenchSetup:
    """What the configurations are built from (command-line options)."""

    target: str
    drafter: str
    num_speculative_tokens: int
    adaflash_config: str | None = None  # path or inline JSON of adaflash.json
    schedule: tuple[tuple[int, int, int], ...] = ()  # (lo, hi, k) batch-size ranges


@dataclass(frozen=True)
class BenchConfig:
    name: str
    speculative_config: dict[str, Any] | None
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def spec_json(self) -> str | None:
        return (
            None
            if self.speculative_config is None
            else json.dumps(self.speculative_config)
        )


def _dflash(setup: BenchSetup) -> dict[str, Any]:
    return {
        "method": "dflash",
        "model": setup.drafter,
        "num_speculative_tokens": setup.num_speculative_tokens,
    }


def _schedule(setup: BenchSetup) -> dict[str, Any]:
    k = setup.num_speculative_tokens
    ranges = setup.schedule or (
        (1, 8, k),
        (9, 32, max(1, k // 2)),
        (33, 1024, max(1, k // 4)),
    )
    return {
        **_dflash(setup),
        "num_speculative_tokens_per_batch_size": [list(r) for r in ranges],
    }


def _adaflash(
    setup: BenchSetup, mode: str | None = None, config: str | None = None
) -> dict[str, Any]:
    config = config or setup.adaflash_config
    if config is None:
        spec = {**_dflash(setup), "adaflash": {}}
    else:
        spec = read_speculative_config(config)
        spec.setdefault("adaflash", {})
    spec = copy.deepcopy(spec)
    spec["model"] = setup.drafter
    spec["num_speculative_tokens"] = setup.num_speculative_tokens
    if mode is not None:
        spec["adaflash"].setdefault("length", {})["mode"] = mode
    return spec


BUILDERS: dict[str, Callable[[BenchSetup], dict[str, Any] | None]] = {
    "plain": lambda s: None,
    "dflash": _dflash,
    "dflash_schedule": _schedule,
    "ngram": lambda s: {
        "method": "ngram",
        "num_speculative_tokens": s.num_speculative_tokens,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "adaflash": _adaflash,
}


def build_config(name: str, setup: BenchSetup) -> BenchConfig:
    """The configuration called `name` (see the module docstring)."""
    if "@" in name:
        label, _, path = name.partition("@")
        if not label or not Path(path).is_file():
            raise AdaFlashConfigError(
                f"configuration {name!r}: use NAME@PATH with an existing adaflash.json"
            )
        return BenchConfig(name=label, speculative_config=_adaflash(setup, config=path))
    base, _, mode = name.partition(":")
    if base not in BUILDERS or (mode and base != "adaflash"):
        raise AdaFlashConfigError(
            f"unknown benchmark configuration {name!r}; choose from "
            f"{', '.join(BUILDERS)} or adaflash:MODE (e.g. adaflash:debug_ragged)"
        )
    spec = _adaflash(setup, mode) if mode else BUILDERS[base](setup)
    return BenchConfig(name=name, speculative_config=spec)


def with_fresh_online(config: BenchConfig, folder: Path) -> BenchConfig:
    """`config` with its online buffer and versions in `folder` (emptied first)."""
    spec = config.speculative_config
    online = ((spec or {}).get("adaflash") or {}).get("online") or {}
    if not online.get("enabled"):
        return config
    shutil.rmtree(folder, ignore_errors=True)
    spec = copy.deepcopy(spec)
    spec["adaflash"]["online"]["buffer_dir"] = str((folder / "buffer").resolve())
    spec["adaflash"]["online"]["versions_dir"] = str((folder / "versions").resolve())
    return BenchConfig(
        name=config.name,
        speculative_config=spec,
        engine_overrides=config.engine_overrides,
    )


def check_paths(setup: BenchSetup) -> None:
    for what, path in (("target", setup.target), ("drafter", setup.drafter)):
        if not Path(path).exists():
            raise AdaFlashConfigError(f"{what} not found: {path}")
