"""The weight channel: a torch.distributed process group between the trainer (rank 0)
and the engine's workers (ranks 1..W), apart from vLLM's own groups.

It is built with vLLM's `stateless_init_torch_distributed_process_group` (its own
TCPStore, no default group touched); gloo on CPU, NCCL on GPU. Only the group's own
point-to-point calls are used, with group-local ranks.

Protocol (worker asks, trainer answers; one request per swap):

    worker -> trainer   int64[2]  (version wanted, 0)
    trainer -> worker   int64[4]  (version sent, meta bytes, data bytes, status)
    trainer -> worker   uint8[meta]  JSON [[key, dtype, shape], ...]
    trainer -> worker   uint8[data]  all tensors' bytes, concatenated in meta order

status 0 = ok; 1 = the trainer does not hold that version (the worker then loads
it from the published folder). Any failure on the worker side (trainer gone,
timeout) falls back to the folder as well, so serving never depends on the trainer.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

OK, NOT_HELD = 0, 1


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def pack_state(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(meta uint8, data uint8) for `state` (keys sorted)."""
    keys = sorted(state)
    meta = [
        [k, str(state[k].dtype).replace("torch.", ""), list(state[k].shape)]
        for k in keys
    ]
    chunks = [
        state[k].detach().cpu().contiguous().reshape(-1).view(torch.uint8) for k in keys
    ]
    data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    meta_t = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return meta_t, data


def unpack_state(meta: torch.Tensor, data: torch.Tensor) -> dict[str, torch.Tensor]:
    items = json.loads(bytes(meta.cpu().numpy()).decode())
    state, offset = {}, 0
    for key, dtype_name, shape in items:
        dtype = _dtype(dtype_name)
        n = int(torch.tensor(shape).prod().item()) if shape else 1
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        state[key] = data[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return state


def make_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
):
    """(group, store): a process group apart from vLLM's, and its own TCPStore."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host,
        port,
        rank,
        world_size,
        backend,
        timeout=timedelta(seconds=timeout_s),
        return_store=True,
    )


def request_key(worker_rank: int) -> str:
    return f"adaflash/request/{worker_rank}"


class PushServer:
    """Trainer side: answers workers' requests with the newest published state.

    Requests arrive as TCPStore keys (polled), so the trainer never waits inside a
    collective while the engine is idle (a gloo receive that times out closes the
    pair for good). The group is rebuilt whenever a worker goes away.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        num_workers: int = 1,
        backend: str = "gloo",
        idle_timeout_s: float = 24 * 3600.0,
    ):
        self.host, self.port, self.backend = host, port, backend
        self.world_size = 1 + num_workers
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._version = 0
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pushes = 0
        self.last_push_s = 0.0
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="adaflash-push", daemon=True
        )

    def start(self) -> PushServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Make `version` the one served to workers from now on."""
        packed = pack_state(state)
        with self._lock:
            self._version, self._packed = version, packed

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                group, store = make_group(
                    self.host,
                    self.port,
                    0,
                    self.world_size,
                    self.backend,
                    self.idle_timeout_s,
                )
            except Exception as e:  # noqa: BLE001  (no worker yet: keep waiting)
                logger.debug("AdaFlash push: waiting for workers (%s)", e)
                time.sleep(1.0)
                continue
            logger.info(
                "AdaFlash push: workers connected on %s:%d", self.host, self.port
            )
            self.connected.set()
            try:
                self._answer_requests(group, store)
            except Exception as e:  # noqa: BLE001
                logger.info("AdaFlash push: channel closed (%s); waiting again", e)
            self.connected.clear()

    def _answer_requests(self, group, store) -> None:
        keys = [request_key(w) for w in range(1, self.world_size)]
        while not self._stop.is_set():
            for worker, key in enumerate(keys, start=1):
                if store.check([key]):
                    wanted = int(store.get(key))
                    store.delete_key(key)
                    self._send(group, worker, wanted)
            time.sleep(0.005)

    def _send(self, group, worker: int, wanted: int) -> None:
        t0 = time.perf_counter()
        with self._lock:
            version, packed = self._version, self._packed
        if packed is None or version != wanted:
            header = torch.tensor([version, 0, 0, NOT_HELD], dtype=torch.int64)
            group.send([header], worker, 0).wait()
            return
        meta, data = packed
        header = torch.tensor(
            [version, meta.numel(), data.numel(), OK], dtype=torch.int64
        )
        group.send([header], worker, 0).wait()
        group.send([meta], worker, 0).wait()
        group.send([data], worker, 0).wait()
        self.pushes += 1
        self.last_push_s = time.perf_counter() - t0


class WorkerChannel:
    """Worker side: fetches a version's state from the trainer over the group.

    Every call is bounded by `timeout_s`; on any failure the group is dropped (and
    rebuilt on the next fetch) and the caller loads the version from disk.
    """

    def __init__(self, *, rank: int, num_workers: int, backend: str, timeout_s: float):
        self.rank, self.world_size = 1 + rank, 1 + num_workers
        self.backend, self.timeout_s = backend, timeout_s
        self._group = None
        self._store = None
        self._session: str | None = None

    def fetch(
        self, version: int, host: str, port: int, session: str
    ) -> dict[str, torch.Tensor] | None:
        """The state of `version`, or None if the trainer does not hold it."""
        if self._group is None or session != self._session:
            self._group, self._store = make_group(
                host, port, self.rank, self.world_size, self.backend, self.timeout_s
            )
            self._session = session
        group = self._group
        try:
            self._store.set(request_key(self.rank), str(version))
            header = torch.zeros(4, dtype=torch.int64)
            group.recv([header], 0, 0).wait()
            sent, meta_len, data_len, status = (int(x) for x in header)
            if status != OK or sent != version:
                return None
            meta = torch.empty(meta_len, dtype=torch.uint8)
            data = torch.empty(data_len, dtype=torch.uint8)
            group.recv([meta], 0, 0).wait()
            group.recv([data], 0, 0).wait()
        except Exception:
            self._group = self._store = None  # rebuild next time
            raise
        return unpack_state(meta, data)
