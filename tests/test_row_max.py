"""The CPU block search for row maxima equals torch's whole-row kernels,
including ties (first index wins), -inf entries and vocabularies that leave a
tail or fill no block."""

import pytest
import torch
from adaflash_vllm.proposers import row_max
from adaflash_vllm.proposers.row_max import first_argmax, top_two


@pytest.fixture(autouse=True)
def _always_blocks(monkeypatch):
    """Take the block search at every size these tests use (12 rows)."""
    monkeypatch.setattr(row_max, "MIN_ELEMENTS", 0)


def _rows(vocab: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(12, vocab) * 3
    x[0, 2:] = float("-inf")
    x[1, -1] = x[1, 0] = x[1].max() + 1  # tied top in the first and last column
    x[2] = 1.0  # every column tied
    x[3] = torch.randint(0, 3, (vocab,)).float()  # many ties
    x[4, vocab // 2] = x[4].max() + 1  # the top in the middle
    if vocab > 64:
        x[5, 63] = x[5, 64] = x[5].max() + 1  # a tie across a block boundary
    return x


@pytest.mark.parametrize("vocab", [1, 2, 63, 64, 127, 128, 129, 200, 4096, 4100])
def test_first_argmax_equals_argmax(vocab):
    for seed in range(3):
        x = _rows(vocab, seed)
        assert torch.equal(first_argmax(x), x.argmax(-1))


@pytest.mark.parametrize("vocab", [1, 2, 63, 64, 127, 128, 129, 200, 4096, 4100])
def test_top_two_equals_topk(vocab):
    for seed in range(3):
        x = _rows(vocab, seed)
        want = x.topk(2, -1).values if vocab > 1 else x.expand(12, 2)
        assert torch.equal(top_two(x), want)


def test_tail_tie_keeps_the_earlier_index():
    x = torch.zeros(1, 130)
    x[0, 5] = x[0, 129] = 2.0
    assert first_argmax(x).item() == 5
    x[0, 129] = 3.0
    assert first_argmax(x).item() == 129


def test_small_inputs_use_torch_kernels(monkeypatch):
    monkeypatch.setattr(row_max, "MIN_ELEMENTS", 1 << 15)
    assert not row_max._use_blocks(torch.zeros(7, 4096))
    assert row_max._use_blocks(torch.zeros(8, 4096))
    assert row_max._use_blocks(torch.zeros(1, 151936))
