"""Engine-test fixtures: plain-vLLM baseline results, computed once per session."""

import pytest

from tests.helpers import PROMPTS, greedy, make_llm, sample_tokens, shutdown

SAMPLE_PROMPT = "hello world, the quick"
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
            "samples": sample_tokens(llm, SAMPLE_PROMPT, NUM_SAMPLES, SAMPLE_POSITIONS),
            "samples_cold": sample_tokens(
                llm, SAMPLE_PROMPT, NUM_SAMPLES, SAMPLE_POSITIONS, temperature=0.7
            ),
        }
    finally:
        shutdown(llm)
