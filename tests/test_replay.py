"""Replay of earlier served traffic in online training (training/replay.py): the
pool's sampling and persistence, and a real trainer round that trains on it."""

from __future__ import annotations

import logging

from adaflash_vllm.training.replay import ReplayPool

from adaflash_vllm.buffer import Trajectory
from tests.helpers import served_trajectories, trainer_config


def _traj(i: int, prompt=(1, 2, 3), output=(4, 5, 6, 7)) -> Trajectory:
    return Trajectory(
        request_id=f"r{i}",
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        round_positions=[],
        round_drafts=[],
        round_accepted=[],
        drafter_version=0,
        temperature=0.0,
        finish_reason="length",
    )


def test_pool_keeps_a_uniform_sample_of_everything_offered():
    """10,000 trajectories offered in rounds of 100 to a pool of 500: each
    tenth of the stream holds about a tenth of the pool (not the newest)."""
    pool = ReplayPool(500, seed=1)
    for start in range(0, 10_000, 100):
        pool.add([_traj(i) for i in range(start, start + 100)])
    assert len(pool) == 500 and pool.seen == 10_000
    tenths = [0] * 10
    for t in pool.items:
        tenths[int(t.request_id[1:]) // 1000] += 1
    assert min(tenths) >= 30 and max(tenths) <= 70, tenths
    drawn = pool.sample(64)
    assert len({t.request_id for t in drawn}) == 64  # without replacement
    assert len(ReplayPool(10).sample(5)) == 0  # an empty pool draws nothing
    small = ReplayPool(10)
    small.add([_traj(i) for i in range(3)])
    assert len(small.sample(5)) == 3


def test_pool_survives_a_restart_and_reports_a_corrupt_file(tmp_path):
    pool = ReplayPool(4, seed=0)
    pool.add([_traj(i) for i in range(10)])
    path = tmp_path / "replay.msgpack"
    pool.save(path)
    again = ReplayPool(4)
    assert again.load(path) is None
    assert [t.request_id for t in again.items] == [t.request_id for t in pool.items]
    assert again.seen == 10
    assert again.items[0].output_token_ids == pool.items[0].output_token_ids
    smaller = ReplayPool(2)
    assert smaller.load(path) is None and len(smaller) == 2
    assert ReplayPool(4).load(tmp_path / "missing") is None
    path.write_bytes(b"\x93not a pool")
    broken = ReplayPool(4)
    problem = broken.load(path)
    assert problem is not None and str(path) in problem and len(broken) == 0


def _trainer(tiny, tmp_path, replay: float):
    from adaflash_vllm.training.online import OnlineTrainer

    cfg = trainer_config(
        tmp_path / "buf", tmp_path / "ver", batch_size=2, replay=replay, replay_pool=6
    )
    return OnlineTrainer(
        cfg,
        target_path=tiny.target,
        drafter_path=str(tiny.drafter_trained),
        num_drafts=3,
        device="cpu",
        push=False,
    )


def test_trainer_rounds_replay_earlier_traffic(tiny, tmp_path, caplog):
    """Round 1 has nothing to replay; round 2 trains on half as many earlier
    trajectories besides its own, in steps of their own (the first epoch's
    measurements stay the new ones'); a restarted trainer has its pool back,
    and one whose pool file is corrupt says so and starts empty."""
    trainer = _trainer(tiny, tmp_path, replay=0.5)
    try:
        first = trainer.train_round(served_trajectories(tiny, 4))
        assert first.replayed == 0 and first.steps == 2
        second = trainer.train_round(served_trajectories(tiny, 4, first=4))
        assert second.replayed == 2 and second.steps == 3  # 2 new + 1 replayed
        assert second.trajectories == 4
        assert len(trainer.replay) == 6 and trainer.replay.seen == 8
    finally:
        trainer.close()
    restarted = _trainer(tiny, tmp_path, replay=0.5)
    try:
        assert len(restarted.replay) == 6 and restarted.replay.seen == 8
    finally:
        restarted.close()
    (tmp_path / "ver" / "trainer" / "replay.msgpack").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        broken = _trainer(tiny, tmp_path, replay=0.5)
    try:
        assert len(broken.replay) == 0
        assert "replay pool could not be read" in caplog.text
    finally:
        broken.close()
    off = _trainer(tiny, tmp_path / "off", replay=0.0)
    try:
        assert off.replay is None
        assert off.train_round(served_trajectories(tiny, 4)).replayed == 0
    finally:
        off.close()
