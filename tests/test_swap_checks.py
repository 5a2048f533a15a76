"""Checks a pushed drafter version must pass before a swap (no engine)."""

import pytest
import torch


def test_finite_checks_run_in_chunks_and_name_the_bad_tensor(monkeypatch):
    """Swap checks run one chunk per unit of staged work and reject NaN/inf
    anywhere, bf16 included (numpy has no bf16)."""
    import adaflash_vllm.swap as swap

    monkeypatch.setattr(swap, "_FINITE_CHUNK", 4)
    good = {"a": torch.ones(10), "b": torch.zeros(3, 3, dtype=torch.bfloat16)}
    assert len(list(swap._finite_checks(good))) == 3 + 3  # ceil(10/4) + ceil(9/4)
    for bad_value in (float("nan"), float("inf")):
        bad = dict(good, c=torch.ones(9, dtype=torch.bfloat16))
        bad["c"][8] = bad_value  # in the last chunk
        with pytest.raises(swap.SwapRejected, match="c: NaN or inf"):
            list(swap._finite_checks(bad))
