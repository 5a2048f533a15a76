"""The paired-round helpers behind examples/compare_*.py (engine-free: the
"engines" here only count what they are served)."""

from __future__ import annotations

import math
import os
import types

import pytest

from adaflash_vllm.bench.paired import (
    Round,
    alternating_rounds,
    cpu_seconds,
    mean_ci,
    paired_ratios,
)


class _Counter:
    def __init__(self, name: str, log: list[str], tokens: int):
        self.name, self.log, self.tokens = name, log, tokens

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(self.name)
        out = types.SimpleNamespace(token_ids=[0] * self.tokens)
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]


def test_rounds_alternate_order_and_cycle_prompts():
    log: list[str] = []
    seen: list[dict] = []
    engines = {"a": (_Counter("a", log, 3), set()), "b": (_Counter("b", log, 5), set())}
    rows = alternating_rounds(
        engines,
        ["p0", "p1", "p2"],
        None,
        rounds=3,
        per_round=2,
        on_round=lambda i, last: seen.append(last),
    )
    assert log == ["a", "b", "b", "a", "a", "b"]
    assert [r.tokens for r in rows["a"]] == [6, 6, 6]
    assert [r.tokens for r in rows["b"]] == [10, 10, 10]
    assert len(seen) == 3 and set(seen[0]) == {"a", "b"}


def test_three_engines_rotate_through_every_place():
    log: list[str] = []
    engines = {n: (_Counter(n, log, 1), set()) for n in "abc"}
    alternating_rounds(engines, ["p0"], None, rounds=3, per_round=1)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_per_prompt_params_follow_their_prompts():
    served: list[tuple] = []

    class _Recorder(_Counter):
        def generate(self, prompts, params, use_tqdm=False):
            served.append((tuple(prompts), tuple(params)))
            return super().generate(prompts, params)

    engines = {"a": (_Recorder("a", [], 1), set())}
    alternating_rounds(engines, ["p0", "p1", "p2"], ["s0", "s1", "s2"], 2, 2)
    assert served == [(("p0", "p1"), ("s0", "s1")), (("p2", "p0"), ("s2", "s0"))]


def test_paired_ratios_are_per_round():
    rows = {
        "base": [Round(100.0, 2.0, 1), Round(50.0, 4.0, 1)],
        "new": [Round(110.0, 1.0, 1), Round(55.0, 2.0, 1)],
    }
    r = paired_ratios(rows, "new", "base")
    assert r["rounds"] == 2
    assert r["tok_s_ratio_mean"] == pytest.approx(1.1)
    assert r["tok_s_ratio_ci95"] == pytest.approx(0.0, abs=1e-12)
    assert r["cpu_per_token_ratio_mean"] == pytest.approx(0.5)


def test_mean_ci():
    m, h = mean_ci([1.0, 3.0])
    assert m == 2.0
    assert h == pytest.approx(1.96 * math.sqrt(2) / math.sqrt(2))
    assert math.isnan(mean_ci([1.0])[1])


def test_cpu_seconds_counts_this_process():
    pytest.importorskip("psutil")
    before = cpu_seconds({os.getpid()})
    x = 0
    for i in range(2_000_000):
        x += i
    assert cpu_seconds({os.getpid()}) > before
    assert cpu_seconds({2**22 + 12345}) == 0.0  # a process that does not exist


def test_staggered_params_are_seeded_greedy_and_within_bounds():
    from adaflash_vllm.bench.paired import staggered_params

    params = staggered_params(200, 96)
    lengths = [p.max_tokens for p in params]
    assert lengths == [p.max_tokens for p in staggered_params(200, 96)]
    assert 32 <= min(lengths) < max(lengths) <= 160 and len(set(lengths)) > 50
    assert all(p.temperature == 0 and p.ignore_eos for p in params)
