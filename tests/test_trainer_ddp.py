"""The online trainer with two data-parallel ranks (real gloo process group) takes
the same steps as one rank on the same global batches."""

import multiprocessing as mp

import pytest
import torch

from adaflash_vllm.config import AdaFlashConfig
from adaflash_vllm.serve_process import free_port
from tests.helpers import served_trajectories, trainer_config


def _cfg(root, tag: str) -> AdaFlashConfig:
    return trainer_config(
        root / f"buf-{tag}", root / f"ver-{tag}", batch_size=4, lr=1e-3
    )


def _rank(rank, world, port, root, tag, target, drafter, trajs, out_q):
    import torch.distributed as dist
    from adaflash_vllm.training.online import OnlineTrainer

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    trainer = OnlineTrainer(
        _cfg(root, tag),
        target_path=target,
        drafter_path=drafter,
        num_drafts=3,
        device="cpu",
        push=False,
        rank=rank,
        world_size=world,
    )
    metrics = trainer.train_round(trajs)
    path = root / f"{tag}-rank{rank}.pt"  # tensors through a queue die with the child
    torch.save(trainer.drafter.state_dict(), path)
    out_q.put((rank, str(path), metrics.loss, trainer.version))
    trainer.close()
    if world > 1:
        dist.destroy_process_group()


def _run(world, tiny, tmp_path, tag):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    args = (
        tmp_path,
        tag,
        str(tiny.target),
        str(tiny.drafter_trained),
        served_trajectories(tiny, 8),
        q,
    )
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, *args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    return [(r, torch.load(path), loss, v) for r, path, loss, v in results]


@pytest.mark.timeout(600)
def test_two_ranks_match_one_rank(tiny, tmp_path):
    one = _run(1, tiny, tmp_path, "one")
    two = _run(2, tiny, tmp_path, "two")
    (_, s0, loss0, v0), (_, s1, _, v1) = two
    assert v0 == v1 == 1 and (tmp_path / "ver-two" / "v00000001").is_dir()
    for key in s0:
        assert torch.equal(s0[key], s1[key]), key  # DDP kept the ranks in sync
    _, single, loss_single, _ = one[0]
    for key in single:
        assert torch.allclose(single[key], s0[key], atol=2e-5), key
    assert abs(loss_single - loss0) < 1e-4 * max(1.0, abs(loss_single))
