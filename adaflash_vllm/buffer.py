"""The trajectory buffer: append-only segment files of msgpack records.

The engine core writes one `Trajectory` per finished request; the trainer tails the
segments. Layout of a segment file `seg-00000001.rec`, repeated per record:

    [u32 little-endian payload length][u32 crc32 of payload][payload: msgpack]

Writing never blocks the engine loop: `BufferWriter.append` only puts the record on
a bounded queue (full queue -> the record is dropped and counted); a daemon thread
encodes and appends. A crash mid-write leaves at most one torn record at the end of
the newest segment; `BufferReader` stops at the last whole record (length and CRC)
and resumes there once the rest arrives or, if the writer moved on to a new
segment, skips the torn tail. The total size is capped: the oldest segments are
deleted (their unread records counted as evicted).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

HEADER = struct.Struct("<II")
SEGMENT_GLOB = "seg-*.rec"


class Trajectory(msgspec.Struct, kw_only=True):
    """What the engine served for one request, for on-policy distillation.

    A round r verified `round_drafts[r]` drafts and accepted `round_accepted[r]`; its
    first new token landed at index `round_positions[r]` of prompt + output, so the
    drafter block of that round was anchored at `round_positions[r] - 1`.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    round_positions: list[int]
    round_drafts: list[int]
    round_accepted: list[int]
    drafter_version: int
    temperature: float
    finish_reason: str
    domain: str | None = None
    created: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Trajectory)


def encode_record(traj: Trajectory) -> bytes:
    payload = _encoder.encode(traj)
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def segment_name(index: int) -> str:
    return f"seg-{index:08d}.rec"


def segment_index(path: Path) -> int:
    return int(path.stem.split("-")[1])


def list_segments(folder: Path) -> list[Path]:
    return sorted(folder.glob(SEGMENT_GLOB), key=segment_index)


@dataclass
class BufferCounters:
    written: int = 0
    dropped_full: int = 0  # queue full (engine faster than the disk)
    dropped_error: int = 0  # disk full, unwritable folder, ...
    evicted_segments: int = 0
    bytes_on_disk: int = 0


class BufferWriter:
    """Bounded, non-blocking writer of trajectories (engine-core side).

    Args:
        folder: the buffer directory (created if missing).
        max_bytes: cap on the total size of all segments.
        segment_bytes: size at which a new segment starts.
        queue_size: records waiting to be written; more are dropped.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        max_bytes: int,
        segment_bytes: int,
        queue_size: int = 1024,
    ):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.counters = BufferCounters()
        self.last_error: str | None = None
        self._queue: queue.Queue[Trajectory | None] = queue.Queue(maxsize=queue_size)
        self._fd: int | None = None
        self._segment = 0
        self._segment_size = 0
        self._thread = threading.Thread(
            target=self._run, name="adaflash-buffer", daemon=True
        )
        self._thread.start()

    def append(self, traj: Trajectory) -> bool:
        """Queue a record; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(traj)
            return True
        except queue.Full:
            self.counters.dropped_full += 1
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout=timeout_s)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued record is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    # ----------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            traj = self._queue.get()
            try:
                if traj is None:
                    break
                self._write(encode_record(traj))
            finally:
                self._queue.task_done()
        if self._fd is not None:
            os.close(self._fd)

    def _write(self, record: bytes) -> None:
        try:
            if self._fd is None or self._segment_size >= self.segment_bytes:
                self._rotate()
            os.write(self._fd, record)
            self._segment_size += len(record)
            self.counters.written += 1
            self.counters.bytes_on_disk += len(record)
            self.last_error = None
        except OSError as e:
            self.counters.dropped_error += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self._fd is not None:  # reopen a fresh segment next time
                os.close(self._fd)
                self._fd = None

    def _rotate(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._fd is not None:
            os.close(self._fd)
        existing = list_segments(self.folder)
        self._segment = max([segment_index(p) for p in existing] + [self._segment]) + 1
        path = self.folder / segment_name(self._segment)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segment_size = 0
        self._enforce_cap(existing)

    def _enforce_cap(self, existing: list[Path]) -> None:
        sizes = [(p, p.stat().st_size) for p in existing if p.exists()]
        total = sum(s for _, s in sizes)
        for path, size in sizes:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            self.counters.evicted_segments += 1
        self.counters.bytes_on_disk = total


@dataclass
class BufferPosition:
    segment: int = 0  # 0 = before the first segment
    offset: int = 0


class BufferReader:
    """Reads whole records from `folder`, starting at `position` (trainer side)."""

    def __init__(
        self, folder: str | os.PathLike, position: BufferPosition | None = None
    ):
        self.folder = Path(folder)
        self.position = position or BufferPosition()
        self.corrupt_records = 0
        self.skipped_segments = 0

    def read_new(self, limit: int | None = None) -> list[Trajectory]:
        """Every whole record after the current position (advancing it)."""
        out: list[Trajectory] = []
        for path in list_segments(self.folder):
            index = segment_index(path)
            if index < self.position.segment:
                continue
            if index > self.position.segment:
                if self.position.segment and not self._segment_exists(
                    self.position.segment
                ):
                    self.skipped_segments += 1  # evicted before we read it
                self.position = BufferPosition(index, 0)
            newer_exists = any(
                segment_index(p) > index for p in list_segments(self.folder)
            )
            self._read_segment(path, out, limit, final=newer_exists)
            if limit is not None and len(out) >= limit:
                break
        return out

    def _segment_exists(self, index: int) -> bool:
        return (self.folder / segment_name(index)).exists()

    def _read_segment(
        self, path: Path, out: list[Trajectory], limit: int | None, final: bool
    ) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        pos = self.position.offset
        while pos + HEADER.size <= len(data):
            if limit is not None and len(out) >= limit:
                break
            length, crc = HEADER.unpack_from(data, pos)
            end = pos + HEADER.size + length
            if end > len(data):
                break  # torn or still being written
            payload = data[pos + HEADER.size : end]
            if zlib.crc32(payload) != crc:
                self.corrupt_records += 1
                pos = len(data)  # cannot resync inside a torn segment
                break
            try:
                out.append(_decoder.decode(payload))
            except msgspec.DecodeError:
                self.corrupt_records += 1
            pos = end
        if final and pos < len(data):
            self.corrupt_records += 1  # a torn tail the writer will never finish
            pos = len(data)
        self.position = BufferPosition(segment_index(path), pos)
