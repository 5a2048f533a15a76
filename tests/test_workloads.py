"""Phase specs of the `shift` stream: joined sets, per-phase counts, repeats."""

import json

import pytest
from transformers import AutoTokenizer

from adaflash_vllm.bench.workloads import REPO_ROOT, load_phase, parse_phase
from adaflash_vllm.errors import AdaFlashConfigError


def test_parse_phase_count_and_default():
    assert parse_phase("math", 240) == ("math", 240)
    assert parse_phase("math+a/b.jsonl:2000", 240) == ("math+a/b.jsonl", 2000)
    # a colon that is not a count belongs to the path
    assert parse_phase("C:/x.jsonl", 7) == ("C:/x.jsonl", 7)
    with pytest.raises(AdaFlashConfigError):
        parse_phase("math:0", 240)
    with pytest.raises(AdaFlashConfigError):
        parse_phase(":12", 240)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO_ROOT / "examples" / "demo" / "target")


def _write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_joined_sets_in_order_then_cycled(tmp_path, tokenizer):
    a = _write(tmp_path / "a.jsonl", ["one", "two"])
    b = _write(tmp_path / "b.jsonl", ["three"])
    phase = load_phase(f"{a}+{b}", tokenizer, count=5)
    assert phase.name == "a+b"
    assert [p for p in phase.prompts] == [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in ["one", "two", "three", "one", "two"]
    ]
    assert phase.repeated == 2
    assert load_phase(f"{a}+{b}", tokenizer, count=3).repeated == 0


def test_bundled_code_stream_has_no_repeats(tokenizer):
    phase = load_phase("code+mbpp_more", tokenizer, count=900)
    assert phase.name == "code+mbpp_more"
    assert len(phase.prompts) == 900 and phase.repeated == 0


def test_level_batch_requests_per_slot():
    from adaflash_vllm.bench.online import level_batch

    prompts = [f"p{i}" for i in range(5)]
    assert len(level_batch(prompts, 1)) == 8  # at least 8
    assert len(level_batch(prompts, 16)) == 32  # two per slot by default
    assert len(level_batch(prompts, 16, 8)) == 128
    assert level_batch(prompts, 4, 3)[:6] == ["p0", "p1", "p2", "p3", "p4", "p0"]


def test_requests_per_slot_out_of_range_is_refused():
    import argparse

    from adaflash_vllm.bench.cli import build_workload

    args = argparse.Namespace(requests_per_slot=0, workload="sweep", max_tokens=8)
    with pytest.raises(AdaFlashConfigError, match="requests-per-slot"):
        build_workload(args, tokenizer=None)
    args = argparse.Namespace(
        requests_per_slot=None, output_len_spread=1.0, workload="sweep", max_tokens=8
    )
    with pytest.raises(AdaFlashConfigError, match="--output-len-spread"):
        build_workload(args, tokenizer=None)


def test_output_lengths_spread():
    from adaflash_vllm.bench.workloads import output_lengths

    assert output_lengths(3, 96) == [96, 96, 96]
    spread = output_lengths(2000, 96, 0.5)
    assert spread == output_lengths(2000, 96, 0.5)  # seeded: every config alike
    assert min(spread) == 48 and max(spread) == 144
    assert abs(sum(spread) / len(spread) - 96) < 2  # the same tokens on average
    assert min(output_lengths(100, 2, 0.9)) >= 1
    for bad in (-0.1, 1.0):
        with pytest.raises(AdaFlashConfigError, match="spread"):
            output_lengths(4, 96, bad)


def test_a_record_with_history_is_templated_as_the_whole_conversation(
    tmp_path, tokenizer
):
    history = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    path = tmp_path / "turns.jsonl"
    path.write_text(
        json.dumps({"prompt": "Go on.", "history": history})
        + "\n"
        + json.dumps({"prompt": "Alone."})
        + "\n"
    )
    phase = load_phase(str(path), tokenizer, count=2)
    assert phase.prompts[0] == tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": "Go on."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert phase.prompts[0].index("Name a colour.") < phase.prompts[0].index("Go on.")
    assert phase.prompts[1] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Alone."}],
        tokenize=False,
        add_generation_prompt=True,
    )


@pytest.mark.parametrize(
    "history, says",
    [
        ("Blue.", "must be a list of chat messages, got str"),
        ([{"role": "robot", "content": "x"}], "message 0 must be"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant"}],
            "message 1 must be",
        ),
    ],
)
def test_a_malformed_history_names_its_line(tmp_path, history, says):
    from adaflash_vllm.training.data import load_prompts

    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": "ok"})
        + "\n"
        + json.dumps({"prompt": "Go on.", "history": history})
        + "\n"
    )
    with pytest.raises(AdaFlashConfigError, match=f"bad.jsonl:2: `history` {says}"):
        load_prompts(path)


def test_without_a_chat_template_the_conversation_is_joined_by_lines():
    from adaflash_vllm.training.data import chat_prompts

    class NoTemplate:
        chat_template = None

    record = {"prompt": "Go on.", "history": [{"role": "user", "content": "Hi."}]}
    assert chat_prompts(NoTemplate(), ["plain", record]) == ["plain", "Hi.\nGo on."]


def test_refill_is_for_offline_shift_streams():
    import argparse

    from adaflash_vllm.bench.cli import build_workload

    for workload, driver in (("sweep", None), ("shift", "serve")):
        args = argparse.Namespace(
            requests_per_slot=None,
            output_len_spread=0.0,
            workload=workload,
            driver=driver,
            refill=True,
            max_tokens=8,
        )
        with pytest.raises(AdaFlashConfigError, match="--refill"):
            build_workload(args, tokenizer=None)


def test_stream_lengths_are_per_request_in_stream_order():
    from adaflash_vllm.bench.offline import stream_lengths
    from adaflash_vllm.bench.workloads import longest_output, output_lengths

    workload = {
        "phases": [{"prompts": ["a"] * 3}, {"prompts": ["b"] * 5}],
        "max_tokens": 96,
        "output_len_spread": 0.5,
    }
    assert stream_lengths(workload) == output_lengths(8, 96, 0.5)
    assert stream_lengths(workload | {"output_len_spread": 0.0}) == [96] * 8
    assert longest_output(96, 0.5) == 144 and longest_output(96) == 96
