"""Row maxima over a long last dimension (drafter logits [R, V]) that run fast on
a CPU: one max pass over blocks of 64 columns, then a search over the block
maxima and inside the best block, in place of `topk` or `argmax` over each whole
row, which the CPU kernels run several times slower (examples/bench_confidence.py).
An accelerator's own kernels are used as they are.
"""

from __future__ import annotations

import torch

BLOCK = 64  # columns per block
# Below this many elements torch's kernel wins (its fewer ops beat the passes
# saved; ~7 rows of a 4,096 vocabulary on the CI machine: examples/bench_confidence.py).
MIN_ELEMENTS = 1 << 15


def _use_blocks(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.shape[1] >= 2 * BLOCK and x.numel() >= MIN_ELEMENTS
    )


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-block head of x viewed [R, V // BLOCK, BLOCK], and the tail."""
    rows, vocab = x.shape
    head = vocab // BLOCK * BLOCK
    return x[:, :head].view(rows, head // BLOCK, BLOCK), x[:, head:]


def _best_block(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, BLOCK]: block index[r] of row r."""
    rows = blocks.shape[0]
    return blocks.gather(1, index.view(rows, 1, 1).expand(rows, 1, BLOCK)).squeeze(1)


def top_two(x: torch.Tensor) -> torch.Tensor:
    """[R, 2]: each row's two largest values (equal when the top is tied); a
    one-column row repeats its value."""
    if not _use_blocks(x):
        if x.shape[1] == 1:
            return x.expand(x.shape[0], 2)
        return x.topk(2, -1).values
    blocks, tail = _blocks(x)
    block_max = blocks.amax(-1)
    best_two = block_max.topk(2, -1)  # _use_blocks: at least two blocks
    inside = _best_block(blocks, best_two.indices[:, 0])
    candidates = [best_two.values[:, 1:], inside.topk(2, -1).values]
    if tail.shape[1]:
        candidates.append(tail.topk(min(2, tail.shape[1]), -1).values)
    return torch.cat(candidates, -1).topk(2, -1).values


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's index of its first largest value, as `x.argmax(-1)`."""
    if not _use_blocks(x):
        return x.argmax(-1)
    blocks, tail = _blocks(x)
    block_max = blocks.amax(-1)
    block_index = block_max.argmax(-1)  # the first block holding the top
    value = block_max.gather(1, block_index.unsqueeze(1)).squeeze(1)
    index = block_index * BLOCK + _best_block(blocks, block_index).argmax(-1)
    if tail.shape[1]:
        later = tail.amax(-1) > value  # a tie keeps the earlier index
        tail_index = tail.argmax(-1) + blocks.shape[1] * BLOCK
        index = torch.where(later, tail_index, index)
    return index
