"""Requests retired from drafting, and the cache blocks their drafter K/V misses.

A step the draft gate skips still writes the drafter's context K/V for every
token the target ran (`_DeferredContext`), so that a later drafting step reads a
complete context. Where skipping wins decisively (under load on a CPU, the
demo's drafter costs ~5% of the target's multiply-adds per token in that
upkeep alone), `adaflash.length.retire_when_skipping` stops it for requests in
decode: such a request is *retired*, its context K/V has holes from then on,
and it never verifies a draft again (budget 0). Prompt tokens keep their upkeep
(a prompt's blocks are what later requests share through the prefix cache).

A hole is in a KV cache block that vLLM's prefix cache may hand to a later
request (a follow-up turn whose prompt contains the retired request's output).
So the blocks that hold holes are kept here, by id in the drafter's KV cache
group: a request whose prefix-cache hit includes one is retired at admission
(its drafts would read the holes; the output would still be exact, as every
draft is verified, but the drafts would be poor). A block's holes end when
vLLM allocates it afresh (a new request's uncached blocks, blocks appended to
a running request): its new owner writes every position it uses.

Pure bookkeeping on the host: no tensors, no vLLM imports.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class RetiredContext:
    """Retired request ids and the block ids whose drafter K/V has holes."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.retired: set[str] = set()
        self.holey: set[int] = set()
        self.retired_total = 0  # requests retired so far (metrics)
        self.retired_on_hit = 0  # of them at admission, on a hit with holes

    def retire(self, req_ids: Iterable[str], slots: Iterable[int]) -> None:
        """`req_ids` skipped the upkeep of the tokens in cache `slots`."""
        before = len(self.retired)
        self.retired.update(req_ids)
        self.retired_total += len(self.retired) - before
        size = self.block_size
        self.holey.update({s // size for s in slots if s >= 0})  # -1: padding

    def admit(self, req_id: str, block_ids: list[int], num_cached: int) -> bool:
        """A request (new, or resumed after preemption) was given `block_ids`, the
        first `num_cached` tokens from the prefix cache. Its uncached blocks are
        fresh; a cached one with holes retires it. Returns whether it is retired."""
        hit = num_cached // self.block_size
        if self.holey:
            self.holey.difference_update(block_ids[hit:])
            if req_id not in self.retired and not self.holey.isdisjoint(
                block_ids[:hit]
            ):
                self.retired.add(req_id)
                self.retired_total += 1
                self.retired_on_hit += 1
        return req_id in self.retired

    def fresh(self, block_ids: Iterable[int]) -> None:
        """Blocks newly appended to a running request: no holes yet."""
        if self.holey:
            self.holey.difference_update(block_ids)

    def forget_finished(self, live: Collection[str]) -> None:
        """Drop ids no longer in the batch (amortised: only once the set holds
        more than twice the live batch). A preempted request dropped here is
        judged again when it resumes (`admit`: its hits on its own blocks)."""
        if len(self.retired) > 2 * len(live) + 8:
            self.retired.intersection_update(live)

    def to_dict(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "retired_now": len(self.retired),
            "retired_total": self.retired_total,
            "retired_on_hit": self.retired_on_hit,
            "holey_blocks": len(self.holey),
        }
