"""Replay of earlier served traffic in online training (`online.replay`).

Each training round distils the drafter on the newest `train_every` trajectories.
When the traffic moves to another domain (or from first turns to follow-ups),
those rounds pull the drafter and its length head toward it, and what it did well
before is forgotten: after 640 second turns tau on the same prompts' first
turns fell 2.70 -> 2.47 and the head's ECE there rose 0.012 -> 0.076
(BENCHMARKS.md run 36). The regression gate cannot see this, since it compares
versions on the traffic being served.

`ReplayPool` keeps a uniform sample of every trajectory trained on so far
(reservoir sampling, `online.replay_pool` of them), and each round also trains on
`online.replay` x `train_every` of them, drawn without replacement. They keep
their logged rounds, so the head trains on them as served. The pool is saved
with the trainer's state (`trainer/replay.msgpack`); a file that cannot be read
is reported and the pool starts empty.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec

from adaflash_vllm.buffer import Trajectory


class ReplayPool:
    """A uniform sample (at most `capacity`) of the trajectories offered."""

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"replay pool capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.items: list[Trajectory] = []
        self.seen = 0  # trajectories offered so far
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, trajectories: list[Trajectory]) -> None:
        """Offer `trajectories`: each of all those offered so far is in the pool
        with the same probability (Algorithm R)."""
        for t in trajectories:
            self.seen += 1
            if len(self.items) < self.capacity:
                self.items.append(t)
            else:
                j = self._rng.randrange(self.seen)
                if j < self.capacity:
                    self.items[j] = t

    def sample(self, n: int) -> list[Trajectory]:
        """Up to `n` distinct trajectories of the pool."""
        n = min(max(n, 0), len(self.items))
        return self._rng.sample(self.items, n)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        state = {"seen": self.seen, "items": self.items}
        tmp.write_bytes(msgspec.msgpack.encode(state))
        os.replace(tmp, path)

    def load(self, path: Path) -> str | None:
        """Restore a saved pool (kept to `capacity`). Returns why it could not
        be read (the pool then stays empty), or None."""
        if not path.exists():
            return None
        try:
            state = msgspec.msgpack.decode(path.read_bytes(), type=_Saved)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            return f"{path}: {e}"
        self.items = state.items[: self.capacity]
        self.seen = max(state.seen, len(self.items))
        return None


class _Saved(msgspec.Struct):
    seen: int
    items: list[Trajectory]
