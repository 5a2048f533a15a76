"""Engines stepped in turn (adaflash_vllm/bench/stepped.py, behind
examples/compare_steps.py), engine-free: the "engines" emit a fixed number of
tokens per request per step and advance a shared fake clock by a fixed cost."""

from __future__ import annotations

import math
import types

import pytest

from adaflash_vllm.bench.stepped import (
    Stream,
    block_ratios,
    config_of,
    episode_ratios,
    pooled_median_step_ms,
    pooled_tok_s,
    ratio_summary,
    request_ratios,
    step_in_turn,
    twin_build_order,
)


class _Engine:
    def __init__(self, name, now, log, tokens_per_step, step_cost):
        self.name, self.now, self.log = name, now, log
        self.tokens_per_step, self.step_cost = tokens_per_step, step_cost
        self.left: dict[str, int] = {}  # request id -> tokens still to emit
        self.added: list[tuple[str, str, int]] = []

    def add_request(self, request_id, prompt, max_tokens):
        self.left[request_id] = max_tokens
        self.added.append((request_id, prompt, max_tokens))

    def step(self):
        self.log.append(self.name)
        self.now[0] += self.step_cost
        outs = []
        for rid in list(self.left):
            n = min(self.tokens_per_step, self.left[rid])
            self.left[rid] -= n
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            out = types.SimpleNamespace(token_ids=[0] * n)
            # vLLM may hand back the id with a suffix of its own
            outs.append(
                types.SimpleNamespace(
                    request_id=f"{rid}-0a1b", finished=done, outputs=[out]
                )
            )
        return outs


class _LLM:
    def __init__(self, engine):
        self.llm_engine = engine
        self.rpcs: list[tuple[str, tuple]] = []

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [None]


def _streams(concurrency, specs, lengths, adaflash=()):
    now, log = [0.0], []
    streams = []
    for name, tokens_per_step, cost in specs:
        llm = _LLM(_Engine(name, now, log, tokens_per_step, cost))
        streams.append(
            Stream(
                name,
                llm,
                concurrency,
                prompts=["p0", "p1", "p2"],
                lengths=lengths,
                adaflash=name in adaflash,
                make_params=lambda n: n,
                clock=lambda: now[0],
            )
        )
    return streams, log


def test_engines_step_in_turn_and_keep_the_batch_full_from_one_stream():
    (a, b), log = _streams(2, [("a", 1, 1.0), ("b", 2, 1.0)], lengths=[2, 4])
    step_in_turn([a, b], 4, order="reverse")
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]
    for s in (a, b):
        added = s.llm.llm_engine.added
        # the same requests in the same order: prompt i and length i (cycled)
        assert [(p, n) for _, p, n in added[:4]] == [
            ("p0", 2),
            ("p1", 4),
            ("p2", 2),
            ("p0", 4),
        ]
        assert s.running == 2 == len(s.llm.llm_engine.left)
    # a (1 token a step) finished request 0 after 2 steps: request 2 came in
    assert [st.batch for st in a.steps] == [2, 2, 2, 2]
    assert [st.new_prompt for st in a.steps] == [True, False, True, False]
    assert [st.tokens for st in a.steps] == [2, 2, 2, 2]
    assert [st.tokens for st in b.steps] == [4, 4, 4, 4]


def test_adaflash_engines_are_told_how_long_they_sat_idle():
    (a, b), _ = _streams(
        1, [("a", 1, 0.010), ("b", 1, 0.030)], lengths=[5], adaflash={"a"}
    )
    step_in_turn([a, b], 3, order="reverse")
    gaps = [args[0] for method, args in a.llm.rpcs if method == "adaflash_exclude_gap"]
    # a, b | b, a | a, b: idle for two of b's steps, then not at all
    assert gaps == pytest.approx([0.060, 0.0])
    assert b.llm.rpcs == []  # not an AdaFlash engine


def test_shuffled_turns_step_every_engine_once_a_step_in_a_seeded_order():
    specs = [(n, 1, 1.0) for n in "abc"]
    streams, log = _streams(1, specs, lengths=[1000])
    step_in_turn(streams, 600)
    turns = [log[i : i + 3] for i in range(0, len(log), 3)]
    assert all(sorted(t) == ["a", "b", "c"] for t in turns)
    # every engine about as often first after its own step (a warm cache):
    # 600 steps, each 1/9 likely per engine; reversing turns gave a and c 299
    # each and b none
    again = {n: 0 for n in "abc"}
    for prev, turn in zip(turns, turns[1:], strict=False):
        if prev[-1] == turn[0]:
            again[turn[0]] += 1
    assert all(40 <= again[n] <= 95 for n in "abc"), again
    rerun, log2 = _streams(1, specs, lengths=[1000])
    step_in_turn(rerun, 600)
    assert log2 == log  # seeded: the same order every run
    with pytest.raises(ValueError, match="order"):
        step_in_turn(streams, 1, order="sorted")


def test_block_ratios_compare_the_same_steps():
    (a, b), _ = _streams(4, [("a", 3, 2.0), ("b", 1, 1.0)], lengths=[1000])
    step_in_turn([a, b], 10)
    assert block_ratios(a, b, skip=2, block=4) == pytest.approx([1.5, 1.5])
    assert a.tok_s(skip=2) == pytest.approx(6.0)
    assert a.median_step_ms(2, new_prompt=False) == pytest.approx(2000.0)
    assert a.median_step_ms(2, new_prompt=True) is None


def test_at_one_request_each_request_is_timed_and_paired():
    # a emits 2 tokens per step at 1 s a step, b 1 token at 1 s a step: each
    # request of 4 tokens takes a 2 s and b 4 s, a tok/s ratio of 2
    (a, b), _ = _streams(1, [("a", 2, 1.0), ("b", 1, 1.0)], lengths=[4])
    step_in_turn([a, b], 12)
    assert a.per_request == pytest.approx({i: 2.0 for i in range(6)})
    assert b.per_request == pytest.approx({0: 4.0, 1: 4.0, 2: 4.0})
    # requests both finished, less the first
    assert request_ratios(a, b) == pytest.approx([2.0, 2.0])
    assert a.request_index("a-17-0a1b") == 17


def test_twins_are_built_at_mirrored_places_and_pooled():
    assert twin_build_order(["a", "b", "plain"]) == [
        "a",
        "b",
        "plain",
        "plain#2",
        "b#2",
        "a#2",
    ]
    assert config_of("plain#2") == "plain" == config_of("plain")
    # a emits 2 tokens a step, its twin 2 as well but at twice the time; b 1
    (a, a2, b), _ = _streams(
        1, [("a", 2, 1.0), ("a#2", 2, 2.0), ("b", 1, 1.0)], lengths=[4]
    )
    step_in_turn([a, a2, b], 12)
    # pooled per block: (2 + 2) tokens in (1 + 2) s against b's 1 token a second
    assert block_ratios([a, a2], b, skip=0, block=4) == pytest.approx([4 / 3] * 3)
    assert pooled_tok_s([a, a2]) == pytest.approx(48 / 36)
    assert pooled_tok_s(a) == a.tok_s() == pytest.approx(2.0)
    # per request: a takes 2 s, its twin 4 s (mean 3), b 4 s; requests 1 and 2
    # (request 0 left out) are the ones all three finished
    assert request_ratios([a, a2], [b]) == pytest.approx([4 / 3, 4 / 3])
    assert request_ratios(b, [a, a2]) == pytest.approx([3 / 4, 3 / 4])
    # medians over both twins' steps (batch full, no new prompt: every other
    # step of a length-4 request at 2 tokens a step)
    assert pooled_median_step_ms([a, a2], 0, new_prompt=False) == pytest.approx(1500.0)


def test_ratio_summary():
    r = ratio_summary([1.0, 1.2, 0.8], "blocks")
    assert r["blocks"] == 3 and r["tok_s_ratio_mean"] == pytest.approx(1.0)
    assert r["tok_s_ratio_median"] == pytest.approx(1.0)
    assert r["tok_s_ratio_ci95"] == pytest.approx(1.96 * 0.2 / math.sqrt(3))
    empty = ratio_summary([], "requests")
    assert empty["requests"] == 0 and math.isnan(empty["tok_s_ratio_mean"])


def test_episodes_drain_before_the_next_starts():
    """`episode` requests per episode: the batch refills within one, falls to
    nothing at its end, and the next starts full; steps say their episode."""
    (a,), _ = _streams(2, [("a", 1, 1.0)], lengths=[2, 4, 1])
    a.episode = 3
    step_in_turn([a], 7)
    # requests 0, 1 (lengths 2, 4); 0 ends after 2 steps and 2 (length 1)
    # comes in and ends; episode 0 drains at one request, then requests 3, 4
    # start together
    assert [st.batch for st in a.steps] == [2, 2, 2, 1, 2, 2, 2]
    assert [st.episode for st in a.steps] == [0, 0, 0, 0, 1, 1, 1]
    assert [rid for rid, _, _ in a.llm.llm_engine.added][:5] == [
        f"a-{i}" for i in range(5)
    ]


def test_episode_ratios_compare_finished_episodes_and_their_drains():
    """Engine b emits twice a's tokens per step at the same cost: 2x over
    each finished episode and over its drain alike; the first episode (warm-up)
    and the unfinished last one are left out."""
    (a, b), _ = _streams(2, [("a", 1, 1.0), ("b", 2, 1.0)], lengths=[4, 8, 2])
    for s in (a, b):
        s.episode = 3
    step_in_turn([a, b], 40)
    whole = episode_ratios(b, a)
    drains = episode_ratios(b, a, drain_below=2)
    done = min(a.steps[-1].episode, b.steps[-1].episode)  # a is slower
    assert set(whole) == set(range(1, done)) and len(whole) >= 2
    assert all(r == pytest.approx(2.0) for r in whole.values())
    assert drains and all(r == pytest.approx(2.0) for r in drains.values())
    assert episode_ratios([b, b], [a, a], skip=0).keys() == {0} | whole.keys()
