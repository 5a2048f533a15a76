"""The trajectory buffer: non-blocking writes, bounded size, crash recovery."""

import os
import time

from adaflash_vllm.buffer import (
    HEADER,
    BufferReader,
    BufferWriter,
    Trajectory,
    encode_record,
    list_segments,
)


def _traj(i: int, n_out: int = 5) -> Trajectory:
    return Trajectory(
        request_id=f"r{i}",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=list(range(n_out)),
        round_positions=[3, 5],
        round_drafts=[3, 2],
        round_accepted=[1, 0],
        drafter_version=0,
        temperature=0.0,
        finish_reason="length",
        domain="math",
    )


def _writer(tmp_path, **kw) -> BufferWriter:
    args = {"max_bytes": 1 << 20, "segment_bytes": 1 << 16, "queue_size": 64} | kw
    return BufferWriter(tmp_path / "buf", **args)


def test_round_trip_and_tailing(tmp_path):
    """Records come back whole and in order; a reader resumes where it stopped."""
    w = _writer(tmp_path)
    for i in range(10):
        assert w.append(_traj(i))
    w.flush()
    r = BufferReader(tmp_path / "buf")
    got = r.read_new()
    assert [t.request_id for t in got] == [f"r{i}" for i in range(10)]
    assert got[3].domain == "math" and got[3].round_positions == [3, 5]
    for i in range(10, 13):
        w.append(_traj(i))
    w.flush()
    assert [t.request_id for t in r.read_new()] == ["r10", "r11", "r12"]
    assert r.read_new() == []
    w.close()


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    w = _writer(tmp_path, queue_size=1)
    w._queue.put(_traj(-1))  # fill the queue before the thread can drain it
    start = time.perf_counter()
    results = [w.append(_traj(i)) for i in range(200)]
    assert time.perf_counter() - start < 0.5  # never waits on the disk
    assert results.count(False) == w.counters.dropped_full > 0
    w.close()


def test_torn_last_record_is_skipped_not_fatal(tmp_path):
    """A crash mid-write loses only the unfinished record."""
    folder = tmp_path / "buf"
    folder.mkdir()
    good = b"".join(encode_record(_traj(i)) for i in range(3))
    torn = encode_record(_traj(3))[: HEADER.size + 4]
    (folder / "seg-00000001.rec").write_bytes(good + torn)
    r = BufferReader(folder)
    assert [t.request_id for t in r.read_new()] == ["r0", "r1", "r2"]
    # the writer restarts (new segment): the torn tail is abandoned, reading goes on
    w = BufferWriter(folder, max_bytes=1 << 20, segment_bytes=1 << 16)
    w.append(_traj(4))
    w.flush()
    assert [t.request_id for t in r.read_new()] == ["r4"]
    assert r.corrupt_records == 1
    w.close()


def test_corrupt_record_detected_by_crc(tmp_path):
    folder = tmp_path / "buf"
    folder.mkdir()
    rec = bytearray(encode_record(_traj(0)))
    rec[-1] ^= 0xFF
    (folder / "seg-00000001.rec").write_bytes(bytes(rec))
    r = BufferReader(folder)
    assert r.read_new() == [] and r.corrupt_records == 1


def test_size_cap_evicts_oldest_segments(tmp_path):
    w = _writer(tmp_path, max_bytes=4000, segment_bytes=1000)
    for i in range(100):
        w.append(_traj(i, n_out=20))
        w.flush()
    segs = list_segments(tmp_path / "buf")
    total = sum(p.stat().st_size for p in segs)
    assert total <= 4000 + 1000 and w.counters.evicted_segments > 0
    assert w.counters.written == 100
    w.close()


def test_unwritable_folder_counts_errors(tmp_path):
    """Disk problems drop records (counted) instead of raising into the engine."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    w = BufferWriter(blocker / "buf", max_bytes=1 << 20, segment_bytes=1 << 16)
    for i in range(3):
        w.append(_traj(i))
    w.flush()
    assert w.counters.dropped_error == 3 and w.last_error
    w.close()
    assert os.path.isfile(blocker)
