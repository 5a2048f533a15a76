"""Requests retired from drafting, and the cache blocks their drafter K/V misses.

A step the draft gate skips still writes the drafter's context K/V for every
token the target ran (`_DeferredContext`), so that a later drafting step reads a
complete context. Where skipping wins decisively (under load on a CPU, the
demo's drafter costs ~5% of the target's multiply-adds per token in that
upkeep alone), `adaflash.length.retire_when_skipping` stops it: every request
of such a step, in its prompt or in decode, is *retired*: its context K/V has
holes from then on, and it verifies no draft (budget 0) while it stays retired.
A retired request drafts again (`unretire`, proposer `_settle_retired`) once
it is in a step whose batch size's gate follows drafting (the load fell), or
in a batch where a check of drafting is due: the drafter then attends to its
holes as they are (slots never written for it). That costs acceptance, not
exactness: on the demo models, 16 requests whose prompt and first 30 tokens
were holes accepted 0.720 drafts a round against 0.833 with the upkeep
(BENCHMARKS.md run 34).

A hole is in a KV cache block that vLLM's prefix cache may hand to a later
request (a shared system prompt, a follow-up turn whose prompt contains a
retired request's output). So the blocks that hold holes are kept here, by id
in the drafter's KV cache group (`RetiredContext.holey`). A request whose
prefix-cache hit includes one is retired at admission and keeps the target's
hit, as plain vLLM would: while the engine retires it would not draft anyway,
and once the engine no longer retires it drafts again over the holes at its
first drafting step. With `length.cut_holey_prefix_hits`, the scheduler
instead cuts such a hit before the first such block once the engine no longer
retires, and takes those blocks out of the prefix cache (`PrefixHoles`,
patches.py E4): the request recomputes from there, its drafter K/V is whole,
it drafts, and later requests hit its complete blocks (off by default: on the
demo models' follow-up turns keeping the hits ran 1.05x as fast, BENCHMARKS.md
run 35). The worker sends the set's changes, `retiring` and whether hits are
cut to the scheduler with each step's output. A block's holes end when vLLM
allocates it afresh (a new request's uncached blocks, blocks appended to a
running request): its new owner writes every position it uses.

Pure bookkeeping on the host: no tensors, no vLLM imports.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

_NO_BLOCKS: frozenset[int] = frozenset()


class RetiredContext:
    """Retired request ids and the block ids whose drafter K/V has holes."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.retired: set[str] = set()
        self.holey: set[int] = set()
        self.retired_total = 0  # requests retired so far (metrics)
        self.unretired_total = 0  # of them drafting again (`unretire`)
        self.retired_on_hit = 0  # of them at admission, on a hit with holes
        # skipped steps' context tokens whose upkeep ran / was dropped (metrics)
        self.kept_tokens = 0
        self.dropped_tokens = 0
        # changes to `holey` since the scheduler last took them (disjoint sets)
        self._added: set[int] = set()
        self._removed: set[int] = set()

    def retire(self, req_ids: Iterable[str], slots: Iterable[int]) -> None:
        """`req_ids` skipped the upkeep of the tokens in cache `slots`."""
        before = len(self.retired)
        self.retired.update(req_ids)
        self.retired_total += len(self.retired) - before
        self.mark(slots)

    def mark(self, slots: Iterable[int]) -> None:
        """The tokens in cache `slots` have no drafter K/V: their blocks have
        holes (-1: padding, skipped)."""
        size = self.block_size
        new = {s // size for s in slots if s >= 0} - self.holey
        if new:
            self.holey |= new
            self._added |= new
            self._removed -= new

    def steps_in_marked_blocks(self, slots: Iterable[int]) -> int:
        """After a decode step of one token per request in cache `slots`
        (marked): how many more such steps of the same requests put every
        request's token in the block of this one (each request's next token
        takes the slot after its last until its block is full), so that they
        add no hole (`SteadySkip.quiet`)."""
        last = self.block_size - 1
        return min((last - s % self.block_size for s in slots if s >= 0), default=0)

    def unretire(self, req_ids: Iterable[str]) -> int:
        """`req_ids` draft again, their holes as they are (the blocks keep their
        marks: a prefix hit on them is still judged by `admit` and
        `PrefixHoles`). Returns how many were retired."""
        back = self.retired.intersection(req_ids)
        if back:
            self.retired -= back
            self.unretired_total += len(back)
        return len(back)

    def admit(self, req_id: str, block_ids: list[int], num_cached: int) -> bool:
        """A request (new, or resumed after preemption) was given `block_ids`, the
        first `num_cached` tokens from the prefix cache. Its uncached blocks are
        fresh; a cached one with holes retires it. Returns whether it is retired."""
        hit = num_cached // self.block_size
        if self.holey:
            self._unmark(block_ids[hit:])
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
            self._unmark(block_ids)

    def _unmark(self, block_ids: Iterable[int]) -> None:
        gone = self.holey.intersection(block_ids)
        if gone:
            self.holey -= gone
            self._removed |= gone
            self._added -= gone

    def take_changes(self) -> tuple[frozenset[int], frozenset[int]]:
        """The block ids that got holes and those that lost them since the last
        call (for the scheduler's `PrefixHoles`)."""
        if not self._added and not self._removed:
            return _NO_BLOCKS, _NO_BLOCKS
        added, removed = frozenset(self._added), frozenset(self._removed)
        self._added.clear()
        self._removed.clear()
        return added, removed

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
            "unretired_total": self.unretired_total,
            "holey_blocks": len(self.holey),
            "upkeep_kept_tokens": self.kept_tokens,
            "upkeep_dropped_tokens": self.dropped_tokens,
        }


class PrefixHoles:
    """The scheduler's side: a copy of the worker's `RetiredContext.holey` (kept
    by the changes each step's output carries) and whether the engine retires,
    to cut prefix-cache hits before blocks with holes while it does not."""

    def __init__(self, block_sizes: list[int | None]):
        """`block_sizes`: each KV cache group's block size (None: a group the
        prefix cache does not serve)."""
        sizes = [b for b in block_sizes if b]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"need a prefix-cached group, got {block_sizes}")
        self.block_sizes = list(block_sizes)
        self.align = math.lcm(*sizes)  # a cut must end a block in every group
        self.blocks: set[int] = set()
        self.retiring = False
        self.cut = False  # length.cut_holey_prefix_hits, as the worker says
        self.gid = 0  # the drafter's KV cache group
        self.block_size = block_sizes[0] or self.align
        self.cut_requests = 0  # hits cut (metrics)
        self.cut_tokens = 0  # tokens those requests recomputed

    def update(
        self,
        retiring: bool,
        gid: int,
        added: Collection[int],
        removed: Collection[int],
        cut: bool = False,
    ) -> None:
        """One step's changes from the worker (`RetiredContext.take_changes`)."""
        self.retiring, self.cut = bool(retiring), bool(cut)
        if gid != self.gid and 0 <= gid < len(self.block_sizes):
            self.gid, self.block_size = gid, self.block_sizes[gid] or self.align
        if removed:
            self.blocks.difference_update(removed)
        if added:
            self.blocks.update(added)

    @property
    def cutting(self) -> bool:
        """Whether hits may be cut now (cuts on, not retiring, some block has
        holes)."""
        return self.cut and not self.retiring and bool(self.blocks)

    def first_hole(self, block_ids: list[int]) -> int | None:
        """Index of the first block of a prefix-cache hit (the drafter group's
        block ids, in order) that holds holes, if the hit is to be cut there:
        never while the engine retires (a hit on holes then retires the request
        at admission instead)."""
        if not self.cutting:
            return None
        for i, block_id in enumerate(block_ids):
            if block_id in self.blocks:
                return i
        return None

    def counters(self) -> dict[str, int]:
        return {
            "retired_prefix_cuts": self.cut_requests,
            "retired_prefix_cut_tokens": self.cut_tokens,
        }
