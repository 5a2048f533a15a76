"""Fast checks on the bundled demo data and target folder (no engine, no training)."""

import json
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
DATA = DEMO / "data"
TARGET = DEMO / "target"
PROMPT_FILES = {
    "prompts_prose.jsonl": "prose",
    "prompts_math.jsonl": "math",
    "prompts_code.jsonl": "code",
    "gsm8k_train_prompts.jsonl": "math",
    "gsm8k_test_prompts.jsonl": "math",
    "mbpp_more_prompts.jsonl": "code",
    "gsm8k_more_prompts.jsonl": "math",
}
# gsm8k_train_prompts is held out from the target but meant for drafter training;
# mbpp_more_prompts holds train_target's MBPP prompts on purpose (a long code stream).
HELD_OUT = [
    n
    for n in PROMPT_FILES
    if n not in ("gsm8k_train_prompts.jsonl", "mbpp_more_prompts.jsonl")
]


def _rows(name):
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _norm(text):
    return " ".join(text.lower().split())


@pytest.fixture(scope="module")
def train():
    return _rows("train_target.jsonl")


@pytest.mark.parametrize("name", ["train_target.jsonl", *PROMPT_FILES])
def test_files_parse_with_required_fields(name):
    """Every bundled record has a str prompt, a domain and a unique id."""
    rows = _rows(name)
    assert rows, name
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids), f"{name}: duplicate ids"
    for r in rows:
        assert isinstance(r["prompt"], str) and r["prompt"].strip(), r["id"]
        assert r["domain"] in ("prose", "math", "code"), r
        if name in PROMPT_FILES:
            assert r["domain"] == PROMPT_FILES[name], r["id"]


def test_train_target_has_responses_in_every_domain(train):
    """The target learns all three domains from prompt -> response pairs."""
    assert {r["domain"] for r in train} == {"prose", "math", "code"}
    assert all(isinstance(r["response"], str) and r["response"] for r in train)


@pytest.mark.parametrize("name", ["prompts_math.jsonl", "prompts_code.jsonl"])
def test_math_and_code_prompts_keep_references(name):
    """GSM8K and MBPP have references, so the held-out sets carry them."""
    assert all(r["response"] for r in _rows(name))


def test_prompt_sets_have_about_300_each():
    """The demo stream and drafter training need a few hundred prompts per domain."""
    for name in ["prompts_prose.jsonl", "prompts_math.jsonl", "prompts_code.jsonl"]:
        assert len(_rows(name)) >= 250, name


@pytest.mark.parametrize("name", HELD_OUT)
def test_held_out_prompts_not_in_train_target(name, train):
    """A held-out prompt that the target trained on would flatter every metric."""
    train_prompts = {_norm(r["prompt"]) for r in train}
    clash = [r["id"] for r in _rows(name) if _norm(r["prompt"]) in train_prompts]
    assert not clash, clash[:5]


def test_prose_prompts_not_inside_train_documents(train):
    """Prose documents are cut from longer texts, so check substrings too."""
    text = "\n".join(_norm(r["prompt"] + " " + r["response"]) for r in train)
    inside = [
        r["id"] for r in _rows("prompts_prose.jsonl") if _norm(r["prompt"]) in text
    ]
    assert not inside, inside[:5]


def test_gsm8k_train_and_test_prompts_disjoint():
    """The from-scratch drafter experiment trains and tests on disjoint prompts."""
    test = {_norm(r["prompt"]) for r in _rows("gsm8k_test_prompts.jsonl")}
    both = [
        r["id"]
        for r in _rows("gsm8k_train_prompts.jsonl")
        if _norm(r["prompt"]) in test
    ]
    assert not both, both[:5]


def test_no_codealpaca_and_licenses_attributed(train):
    """CodeAlpaca is non-commercial; every bundled source ships its license."""
    all_ids = [r["id"] for r in train] + [
        r["id"] for n in PROMPT_FILES for r in _rows(n)
    ]
    assert not [i for i in all_ids if "codealpaca" in i.lower()]
    attribution = (DATA / "ATTRIBUTION.md").read_text()
    licenses = sorted(p.name for p in (DATA / "licenses").iterdir())
    assert len(licenses) == 5, licenses
    assert "codealpaca" not in " ".join(licenses).lower()
    for repo in [
        "openai/grade-school-math",
        "ZubinGou/math-evaluation-harness",
        "deepseek-ai/DeepSeek-Coder",
        "ml-energy/leaderboard-v2",
        "hemingkx/Spec-Bench",
    ]:
        assert repo in attribution, repo


def test_code_stream_is_all_of_mbpp_once():
    """prompts_code + mbpp_more_prompts: a long code phase that repeats nothing."""
    ids = [
        r["id"] for r in _rows("prompts_code.jsonl") + _rows("mbpp_more_prompts.jsonl")
    ]
    assert len(ids) == len(set(ids)) == 974


def test_math_stream_repeats_nothing():
    """gsm8k_test + gsm8k_more (all of GSM8K test) + gsm8k_train prompts."""
    names = ["gsm8k_test_prompts.jsonl", "gsm8k_more_prompts.jsonl"]
    test_ids = [r["id"] for n in names for r in _rows(n)]
    assert len(test_ids) == len(set(test_ids)) == 1319
    texts = [_norm(r["prompt"]) for n in names for r in _rows(n)]
    texts += [_norm(r["prompt"]) for r in _rows("gsm8k_train_prompts.jsonl")]
    assert len(set(texts)) == len(texts)


def test_data_folder_under_cap():
    """The bundled data must stay small enough to ship in the repository."""
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 4_500_000, total  # demo_data.SIZE_CAP


def test_target_folder_is_a_vllm_cpu_qwen3():
    """vLLM's CPU attention needs head_dim >= 32; DFlash needs `<|mask|>`."""
    if not (TARGET / "model.safetensors").exists():
        pytest.skip("target not built (python examples/demo/build_demo.py)")
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] >= 32 and cfg["tie_word_embeddings"]
    tok = json.loads((TARGET / "tokenizer.json").read_text())
    specials = {t["content"] for t in tok["added_tokens"]}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"} <= specials
    assert (TARGET / "chat_template.jinja").exists() or "chat_template" in (
        TARGET / "tokenizer_config.json"
    ).read_text()
    assert (TARGET / "README.md").exists() and (
        TARGET / "generation_config.json"
    ).exists()
