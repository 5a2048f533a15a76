"""Published drafter versions: one folder per version, written atomically.

    versions_dir/
      v00000003/ config.json  model.safetensors  manifest.json
      LATEST           "3" (atomic rename after the folder is complete)
      rejected.json    {"3": "reason"}  (versions the engine refused or rolled back)

Each version folder is a complete z-lab drafter checkpoint, so any engine (stock
vLLM included) can load it. Version 0 is the drafter the engine started with and is
never written here.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaflash_vllm.training.checkpoint import WEIGHTS_NAME, load_drafter, save_drafter

MANIFEST = "manifest.json"


def version_dirname(version: int) -> str:
    return f"v{version:08d}"


@dataclass
class VersionInfo:
    version: int
    path: Path
    manifest: dict[str, Any]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def publish_version(
    versions_dir: str | os.PathLike,
    version: int,
    cfg: dict,
    state: dict[str, torch.Tensor],
    manifest: dict[str, Any],
) -> Path:
    """Write version `version` (folder, then LATEST); never leaves a torn folder."""
    root = Path(versions_dir)
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        **manifest,
        "version": version,
        "created": time.time(),
        "keys": sorted(state),
    }
    out = save_drafter(
        root / version_dirname(version),
        cfg,
        state,
        extra_files={MANIFEST: json.dumps(manifest, indent=1).encode()},
    )
    _write_atomic(root / "LATEST", str(version))
    return out


def read_version(versions_dir: str | os.PathLike, version: int) -> VersionInfo | None:
    path = Path(versions_dir) / version_dirname(version)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not (path / WEIGHTS_NAME).exists():
        return None
    return VersionInfo(version, path, manifest)


def latest_version(versions_dir: str | os.PathLike) -> int:
    """The newest published version number (0 when nothing was published)."""
    try:
        return int((Path(versions_dir) / "LATEST").read_text().strip())
    except (OSError, ValueError):
        return 0


def rejected_versions(versions_dir: str | os.PathLike) -> dict[int, str]:
    try:
        data = json.loads((Path(versions_dir) / "rejected.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(k): v for k, v in data.items()}


def mark_rejected(versions_dir: str | os.PathLike, version: int, reason: str) -> None:
    root = Path(versions_dir)
    root.mkdir(parents=True, exist_ok=True)
    data = {str(k): v for k, v in rejected_versions(root).items()}
    data[str(version)] = reason
    _write_atomic(root / "rejected.json", json.dumps(data, indent=1))


def newest_good_version(
    versions_dir: str | os.PathLike, below: int | None = None
) -> VersionInfo | None:
    """The newest complete, not rejected version (optionally older than `below`)."""
    root = Path(versions_dir)
    if not root.is_dir():
        return None
    bad = rejected_versions(root)
    numbers = sorted(
        (int(p.name[1:]) for p in root.glob("v[0-9]*") if p.is_dir()), reverse=True
    )
    for n in numbers:
        if n in bad or (below is not None and n >= below):
            continue
        info = read_version(root, n)
        if info is not None:
            return info
    return None


def load_version_state(info: VersionInfo) -> tuple[dict, dict[str, torch.Tensor]]:
    return load_drafter(info.path)
