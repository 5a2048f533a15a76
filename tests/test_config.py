"""adaflash.json parsing: valid sections, clear errors, docs in sync."""

import json
import re
from pathlib import Path

import pytest

from adaflash_vllm.config import (
    AdaFlashConfig,
    iter_config_keys,
    parse_adaflash_section,
    read_speculative_config,
    split_adaflash_section,
)
from adaflash_vllm.errors import AdaFlashConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_empty_section_gives_defaults():
    """`"adaflash": {}` turns AdaFlash on with every default."""
    assert parse_adaflash_section({}) == AdaFlashConfig()


@pytest.mark.parametrize(
    "section, fragment",
    [
        # a typo at the top level names the key and lists the valid ones
        ({"lenght": {}}, "unknown key `adaflash.lenght`. Did you mean `length`?"),
        # nested typo: path and valid siblings
        (
            {"length": {"mod": "fixed"}},
            "Valid keys in `adaflash.length`: adaptive_block, cut_holey_prefix_hits, "
            "gamma, k_min, mode",
        ),
        # wrong enum value names the allowed ones
        ({"length": {"mode": "adaptive"}}, "adaflash.length.mode"),
        # out-of-range number names the bound
        ({"metrics": {"publish_interval_s": -1}}, ">= 0.0"),
        # wrong type
        ({"metrics": []}, "`adaflash.metrics` must be a JSON object"),
    ],
)
def test_bad_section_errors_name_the_key(section, fragment):
    """Every bad key or value fails with an error naming it (no traceback soup)."""
    with pytest.raises(AdaFlashConfigError) as e:
        parse_adaflash_section(section)
    assert fragment in str(e.value)


def test_unknown_key_lists_all_valid_keys():
    with pytest.raises(AdaFlashConfigError) as e:
        parse_adaflash_section({"nope": 1})
    for key in ("length", "metrics", "per_request_metrics"):
        assert key in str(e.value)


def test_split_requires_dflash_and_k_in_range():
    spec = {
        "method": "dflash",
        "model": "m",
        "num_speculative_tokens": 3,
        "adaflash": {},
    }
    vllm_spec, cfg = split_adaflash_section(spec)
    assert "adaflash" not in vllm_spec and cfg == AdaFlashConfig()
    assert "adaflash" in spec  # the caller's dict is not modified
    with pytest.raises(AdaFlashConfigError, match='"method": "dflash"'):
        split_adaflash_section({**spec, "method": "eagle3"})
    for k in (0, 33, "3", None):
        with pytest.raises(AdaFlashConfigError, match="num_speculative_tokens"):
            split_adaflash_section({**spec, "num_speculative_tokens": k})


def test_no_section_is_stock_vllm():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert split_adaflash_section(spec) == (spec, None)


def test_read_speculative_config_path_inline_and_errors(tmp_path):
    """A file path, inline JSON and a dict all work; bad paths/JSON say why."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    cfg = tmp_path / "adaflash.json"
    cfg.write_text(json.dumps({"model": "drafter", "num_speculative_tokens": 3}))
    assert read_speculative_config(str(cfg))["model"] == str(drafter.resolve())
    assert read_speculative_config('{"a": 1}') == {"a": 1}
    assert read_speculative_config({"a": 1}) == {"a": 1}
    with pytest.raises(AdaFlashConfigError, match="not found"):
        read_speculative_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": }')
    with pytest.raises(AdaFlashConfigError, match="not valid JSON.*line 1"):
        read_speculative_config(str(bad))


def test_config_docs_list_every_key():
    """docs/CONFIG.md documents exactly the keys the structs accept."""
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    documented = set(re.findall(r"^\| `(adaflash\.[a-z_.]+)` \|", text, flags=re.M))
    assert documented == set(iter_config_keys())


def test_example_config_parses():
    """examples/adaflash.json is a valid AdaFlash config."""
    spec = json.loads((ROOT / "examples" / "adaflash.json").read_text())
    vllm_spec, cfg = split_adaflash_section(spec)
    assert cfg is not None and vllm_spec["method"] == "dflash"
