"""The wheel ships every package: a subpackage missing from pyproject's list works
in the editable checkout CI installs but is absent from `pip install adaflash-vllm`."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    listed = set(setuptools["packages"])
    dirs = setuptools["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found, "no packages found under package-dir"
    assert found <= listed, (
        f"packages not shipped in the wheel: {sorted(found - listed)}"
    )
