"""Engine-test fixtures: plain-vLLM baseline results, computed once per session."""

import pytest

from tests.helpers import (
    PROMPTS,
    greedy,
    greedy_with_cache_hits,
    make_llm,
    make_prompts,
    sample_tokens,
    shutdown,
)

SAMPLE_PROMPT = "hello world, the quick"
LONG_PROMPTS = make_prompts(6, seed=3, min_words=200, max_words=260)
"""Prompts longer than two KV blocks (128 tokens each on CPU), served twice."""
NUM_SAMPLES = 300
SAMPLE_POSITIONS = (0, 3)


@pytest.fixture(scope="session")
def baseline(tiny):
    """Plain vLLM (no speculation) on the tiny target: greedy outputs for PROMPTS,
    and T=1 (plus a T=0.7 control) samples for the distribution tests."""
    llm = make_llm(tiny.target)
    try:
        return {
            "greedy": greedy(llm, PROMPTS),
            "long": [greedy_with_cache_hits(llm, LONG_PROMPTS) for _ in range(2)],
            "samples": sample_tokens(llm, SAMPLE_PROMPT, NUM_SAMPLES, SAMPLE_POSITIONS),
            "samples_cold": sample_tokens(
                llm, SAMPLE_PROMPT, NUM_SAMPLES, SAMPLE_POSITIONS, temperature=0.7
            ),
        }
    finally:
        shutdown(llm)
