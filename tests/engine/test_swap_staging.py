"""Swaps staged in slices between steps (`online.swap_staging: "slices"`, the
default) and in the fetch thread (`"thread"`): the work runs where the mode says,
the swap lands, output stays token-identical to plain vLLM, and the drafts after
it equal those of a fresh engine started on the published checkpoint."""

import json
import time

import pytest
from adaflash_vllm.training.checkpoint import load_drafter

from adaflash_vllm.versions import publish_version
from tests.engine.test_online import _draft_logits, assert_drafts_equal_fresh_engine
from tests.helpers import PROMPTS, greedy, make_llm, metrics, shutdown

pytestmark = pytest.mark.engine

K = 3


@pytest.mark.parametrize("staging", ["slices", "thread"])
def test_staging_swaps_to_the_published_drafter(tiny, baseline, tmp_path, staging):
    spec = tiny.spec(
        k=K,
        adaflash={
            "online": {
                "enabled": True,
                "push": False,
                "buffer_dir": str(tmp_path / "buffer"),
                "versions_dir": str(tmp_path / "versions"),
                "poll_interval_s": 0.05,
                "gate_window": 0,
                "swap_staging": staging,
            }
        },
    )
    cfg, state = load_drafter(tiny.drafter_trained)
    changed = {k: v * 1.05 if v.dim() == 2 else v for k, v in state.items()}
    prompts = PROMPTS[20:24]
    llm = make_llm(tiny.target, json.loads(json.dumps(spec)))
    try:
        llm.collective_rpc("adaflash_timeline", args=(True,))
        path = publish_version(tmp_path / "versions", 1, cfg, changed, {"test": 1})
        deadline = time.monotonic() + 90
        while metrics(llm).get("vllm:adaflash_drafter_version") != 1:
            assert time.monotonic() < deadline, "version 1 never went live"
            assert greedy(llm, PROMPTS[:4], max_tokens=8) == [
                b[:8] for b in baseline["greedy"][:4]
            ]
        events = llm.collective_rpc("adaflash_timeline", args=(False,))[0]
        kinds = [e[0] for e in events]
        assert "write" in kinds, kinds
        if staging == "slices":  # checked and staged between steps, then written
            assert "stage" in kinds, kinds
            assert kinds.index("fetch") < kinds.index("stage") < kinds.index("write")
        else:  # all in the fetch thread: no step carried a slice of it
            assert "stage" not in kinds, kinds
            assert kinds.index("fetch") < kinds.index("write")
        swapped = _draft_logits(llm, prompts)
        assert greedy(llm, PROMPTS) == baseline["greedy"]
    finally:
        shutdown(llm)
    assert_drafts_equal_fresh_engine(tiny, path, prompts, swapped)
