"""The weight channel: a real torch.distributed (gloo) group between two processes."""

import multiprocessing as mp

import torch

from adaflash_vllm.serve_process import free_port
from adaflash_vllm.transport import pack_state, unpack_state


def test_pack_round_trip_keeps_dtype_and_shape():
    state = {
        "b": torch.randn(3, 4),
        "a": torch.arange(6, dtype=torch.bfloat16),
        "c": torch.tensor(2.5),
    }
    got = unpack_state(*pack_state(state))
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)


def _trainer(port, ready, done):
    from adaflash_vllm.transport import PushServer

    srv = PushServer("127.0.0.1", port).start()
    srv.offer(7, {"w": torch.full((4, 4), 3.0), "n": torch.ones(4)})
    ready.set()
    done.wait(60)


def _worker(port, ready, out):
    from adaflash_vllm.transport import WorkerChannel

    ready.wait(60)
    ch = WorkerChannel(rank=0, num_workers=1, backend="gloo", timeout_s=20)
    state = ch.fetch(7, "127.0.0.1", port, "s1")
    again = ch.fetch(7, "127.0.0.1", port, "s1")
    missing = ch.fetch(8, "127.0.0.1", port, "s1")
    out.put((float(state["w"].sum()), float(again["n"].sum()), missing is None))


def test_push_server_serves_worker_over_gloo():
    """A worker process pulls a version from a trainer process (twice), and a version
    the trainer does not hold comes back as None (the worker then reads disk)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(port, ready, done))
    worker = ctx.Process(target=_worker, args=(port, ready, out))
    trainer.start()
    worker.start()
    try:
        w_sum, n_sum, missing = out.get(timeout=120)
    finally:
        done.set()
        worker.join(30)
        trainer.join(30)
        for p in (worker, trainer):
            if p.is_alive():
                p.kill()
    assert (w_sum, n_sum, missing) == (48.0, 4.0, True)
