"""examples/compare_no_draft.py's configuration names (shared by compare_steps.py
and step_timers.py): the `adaflash:alt` drafter folder."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "examples" / "compare_no_draft.py"
_spec = importlib.util.spec_from_file_location("compare_no_draft", _PATH)
configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(configs)


def test_alt_serves_the_drafter_folder_the_environment_names(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv(configs.ALT_DRAFTER_ENV, str(tmp_path))
    spec = configs._spec("adaflash:alt+noskip")
    assert spec["model"] == str(tmp_path)
    assert spec["adaflash"]["length"] == {"mode": "cost_aware", "skip_drafting": False}
    assert configs._spec("adaflash")["model"] == str(configs.DEMO / "drafter")
    # a configuration name the scripts accept (plain is always run too)
    assert configs.parse_configs("adaflash,adaflash:alt") == [
        "plain",
        "adaflash",
        "adaflash:alt",
    ]


def test_alt_without_a_drafter_folder_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv(configs.ALT_DRAFTER_ENV, raising=False)
    with pytest.raises(ValueError, match="ADAFLASH_ALT_DRAFTER"):
        configs._spec("adaflash:alt")
    monkeypatch.setenv(configs.ALT_DRAFTER_ENV, str(tmp_path))  # no config.json
    with pytest.raises(ValueError, match="drafter folder"):
        configs._spec("adaflash:alt")
