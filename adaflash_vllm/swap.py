"""Hot swap of drafter weights inside a running vLLM worker (in place, between steps).

vLLM's own reload paths break DFlash on CPU: linear weights are prepacked (the
`.weight` becomes an empty tensor) and `_fused_kv_weight` / `_k_norm_weights` are
copies built at load time. A swap therefore writes every drafter-owned tensor in
place, the fused K/V weight and stacked k-norms included (stable addresses, so CUDA
graphs that captured them stay valid), and gives each prepacked CPU linear new
packed weights. It runs in two parts: `staging_steps` (checks, concatenations,
dtype conversion and the CPU re-pack; in the fetch thread or in slices between
steps, see `DrafterSwapper`) and `write_staged` (between steps: handle
assignments and in-place copies only). The embedding and lm_head are shared with
the target and are never written: a state that names them is rejected.

Checkpoint names (z-lab) -> vLLM modules, layer i:
    self_attn.{q,k,v}_proj -> self_attn.qkv_proj (rows q | k | v)
    mlp.{gate,up}_proj     -> mlp.gate_up_proj   (rows gate | up)
    everything else        -> the module of the same name
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from vllm.logger import init_logger

from adaflash_vllm.errors import AdaFlashError

logger = init_logger(__name__)


class SwapRejected(AdaFlashError, ValueError):
    """A pushed drafter state is unusable (keys, shapes or values); not applied."""


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape for the live drafter `model` (vLLM module)."""
    cfg = model.config
    h, hd = (
        cfg.hidden_size,
        getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads),
    )
    nh, nkv, inter = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["norm.weight"] = (h,)
    shapes["hidden_norm.weight"] = (h,)
    if getattr(model.model, "use_aux_hidden_state", True):
        shapes["fc.weight"] = (h, model.model.fc.input_size)
    head = getattr(model, "length_head", None)
    if head is not None:
        shapes.update(
            {f"length_head.{k}": tuple(v.shape) for k, v in head.state_dict().items()}
        )
    return shapes


def validate_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise SwapRejected unless `state` has exactly the drafter's keys and shapes,
    and only finite values."""
    check_shapes(model, state)
    for _ in _finite_checks(state):
        pass


def check_shapes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise SwapRejected unless `state` has exactly the drafter's keys and
    shapes, none of them target-owned."""
    shapes = expected_shapes(model)
    owned = [k for k in state if "embed_tokens" in k or "lm_head" in k]
    if owned:
        raise SwapRejected(f"state writes target-owned tensors {owned}")
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or extra:
        raise SwapRejected(
            f"key mismatch: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for key, shape in shapes.items():
        got = tuple(state[key].shape)
        if got != shape:
            raise SwapRejected(f"{key}: shape {got}, drafter has {shape}")


_FINITE_CHUNK = 1 << 20  # elements per finite check (one unit of staged work)


def _finite_checks(state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Check every value is finite, one chunk per step of the iteration; raise
    SwapRejected at the first tensor with NaN or inf."""
    for key, value in state.items():
        for chunk in value.reshape(-1).split(_FINITE_CHUNK):
            if not _all_finite(chunk):
                raise SwapRejected(f"{key}: NaN or inf values")
            yield


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`. On CPU through numpy, whose check is ~10x faster than
    torch's there (6.4 vs 0.6 ms for the demo drafter; it runs on the engine's
    cores while they serve)."""
    if t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    if t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()  # bfloat16 has no numpy dtype
    return bool(np.isfinite(t.detach().numpy()).all())


@dataclass
class StagedState:
    """A checked drafter state made ready to write: what can be done before the
    step (concatenations, dtype conversion, the CPU re-pack of prepacked linears)
    is done, so that `write_staged` only assigns packed handles and copies."""

    packed: list[tuple[nn.Module, object]]  # (live CPU linear, its new cpu_linear)
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, new value)


def _stage_linear(layer: nn.Module, weight: torch.Tensor, staged: StagedState) -> None:
    dtype = getattr(layer, "params_dtype", None) or layer.weight.dtype
    weight = weight.to(dtype=dtype)
    if layer.weight.numel() == 0:  # CPU: prepacked, the plain weight was removed
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        scratch = nn.Module()  # packed like the live layer, off the step
        scratch.weight = nn.Parameter(weight.clone(), requires_grad=False)
        bias = getattr(layer, "bias", None)
        scratch.bias = None if bias is None else bias.detach().clone()
        dispatch_cpu_unquantized_gemm(scratch, remove_weight=True)
        staged.packed.append((layer, scratch.cpu_linear))
    else:
        staged.copies.append((layer.weight.data, weight))


def _stage_copy(param: torch.Tensor, value: torch.Tensor, staged: StagedState) -> None:
    staged.copies.append((param.data, value.to(dtype=param.dtype)))


def stage_drafter_state(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> StagedState:
    """Prepare a validated `state` for `write_staged` at once."""
    steps = staging_steps(model, state, check=False)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.no_grad()
def staging_steps(
    model: nn.Module, state: dict[str, torch.Tensor], *, check: bool = True
) -> Generator[None, None, StagedState]:
    """Check (unless `check` is False: the caller did) and stage `state` in small
    units of work, one per iteration (a finite check of up to 1M values, one
    linear's re-pack); returns the StagedState. It reads the live model's layout,
    never its values, so it may run in any thread or in slices between steps.
    Raises SwapRejected for a state that fails the checks."""
    if check:
        check_shapes(model, state)
        yield from _finite_checks(state)
    staged = StagedState(packed=[], copies=[])
    inner = model.model
    fused_kv, k_norms = [], []
    for i, layer in enumerate(inner.layers):
        p = f"layers.{i}."
        attn = layer.self_attn
        k, v = (
            state[p + "self_attn.k_proj.weight"],
            state[p + "self_attn.v_proj.weight"],
        )
        _stage_linear(
            attn.qkv_proj,
            torch.cat([state[p + "self_attn.q_proj.weight"], k, v]),
            staged,
        )
        yield
        _stage_linear(attn.o_proj, state[p + "self_attn.o_proj.weight"], staged)
        yield
        _stage_copy(attn.q_norm.weight, state[p + "self_attn.q_norm.weight"], staged)
        _stage_copy(attn.k_norm.weight, state[p + "self_attn.k_norm.weight"], staged)
        _stage_linear(
            layer.mlp.gate_up_proj,
            torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
            ),
            staged,
        )
        yield
        _stage_linear(layer.mlp.down_proj, state[p + "mlp.down_proj.weight"], staged)
        yield
        _stage_copy(
            layer.input_layernorm.weight, state[p + "input_layernorm.weight"], staged
        )
        _stage_copy(
            layer.post_attention_layernorm.weight,
            state[p + "post_attention_layernorm.weight"],
            staged,
        )
        fused_kv.append(torch.cat([k, v]))
        k_norms.append(state[p + "self_attn.k_norm.weight"])
    _stage_copy(inner.norm.weight, state["norm.weight"], staged)
    # hidden_norm's weight is aliased by a buffer: written in place, both see it.
    _stage_copy(inner.hidden_norm.weight, state["hidden_norm.weight"], staged)
    if "fc.weight" in state:
        _stage_linear(inner.fc, state["fc.weight"], staged)
        yield
    head = getattr(model, "length_head", None)
    if head is not None:
        for name, param in head.state_dict().items():
            _stage_copy(param, state[f"length_head.{name}"], staged)
    if getattr(inner, "_fused_kv_weight", None) is not None:
        _stage_copy(inner._fused_kv_weight, torch.cat(fused_kv), staged)
    if getattr(inner, "_k_norm_weights", None) is not None:
        _stage_copy(inner._k_norm_weights, torch.stack(k_norms), staged)
    return staged


@torch.no_grad()
def write_staged(staged: StagedState) -> None:
    """Between steps: point each CPU linear at its new packed weights and copy
    every other tensor in place (stable addresses, so CUDA graphs that captured
    them stay valid)."""
    for layer, cpu_linear in staged.packed:
        layer.cpu_linear = cpu_linear
    for param, value in staged.copies:
        param.copy_(value)


def apply_drafter_state(
    model: nn.Module, state: dict[str, torch.Tensor], *, validated: bool = False
) -> None:
    """Validate (unless the caller did), then write `state` into the live drafter
    `model` (stage and write at once)."""
    if not validated:
        validate_state(model, state)
    write_staged(stage_drafter_state(model, state))


def tensor_checksum(tensors: list[torch.Tensor]) -> str:
    """Order-sensitive checksum of tensor bytes (exact, for never-touch checks)."""
    import hashlib

    digest = hashlib.sha256()
    for t in tensors:
        flat = t.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def target_checksum(target: nn.Module) -> str:
    return tensor_checksum([p for _, p in sorted(target.named_parameters())])


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


STAGE_BUDGET_S = 0.002
"""Staging work one step may carry in the `slices` mode (checks, re-packs)."""


@dataclass
class _Fetch:
    """One version being received (background thread), then checked and staged
    (see `DrafterSwapper` for where)."""

    version: int
    thread: threading.Thread | None = None
    state: dict[str, torch.Tensor] | None = None
    steps: Generator[None, None, StagedState] | None = None
    staged: StagedState | None = None
    via: str = "folder"
    error: str | None = None
    fetch_s: float = 0.0  # receiving, in the background
    stage_s: float = 0.0  # checking and staging, summed over the steps
    stage_steps: int = 0  # steps that carried a slice of it
    max_slice_s: float = 0.0  # the most any one step waited for it


class DrafterSwapper:
    """Worker side of online swaps: fetch a version (push, else its folder), check
    it, write it in place, record the version.

    Receiving runs in a background thread (it blocks on the trainer or the disk).
    Checking and staging (`staging_steps`) then run as `staging` says:

        slices    between steps, about `STAGE_BUDGET_S` per step (default:
                  bounded work per step, no thread competing with the steps
                  for a core or the GIL);
        thread    in the fetch thread, beside the steps (it takes its time out
                  of the steps it overlaps unless a core is spare);
        one_step  all in the step that writes the version.

    The step that finds the version staged writes it (handle assignments and
    in-place copies). Until then each order answers "pending" and the scheduler
    orders it again next step. A resume at startup (no traffic yet) runs inline.
    On one shared CPU core the three cost about the same in total, but `slices`
    spreads it: p99 inter-token latency in swap windows 1.00x of the others
    served, `thread` 1.10x (BENCHMARKS.md, run D).

    Args:
        model: the live vLLM drafter (`AdaFlashDFlashForCausalLM`).
        staging: "thread", "slices" or "one_step".
        push_timeout_s: bound on every wait for the trainer.
        backend: "gloo" on CPU, "nccl" on GPU.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        push_timeout_s: float,
        backend: str,
        staging: str = "slices",
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        from adaflash_vllm.transport import WorkerChannel

        if staging not in ("slices", "thread", "one_step"):
            raise ValueError(f"unknown swap staging {staging!r}")
        self.staging = staging
        self.model = model
        self.tp_size = tp_size
        self.channel = WorkerChannel(
            rank=tp_rank, num_workers=tp_size, backend=backend, timeout_s=push_timeout_s
        )
        self._push_broken_session: str | None = None
        self._fetch: _Fetch | None = None
        self.timeline: list[tuple[str, float, float, float]] | None = None  # debug

    def load_folder(self, path: str, version: int) -> None:
        from adaflash_vllm.training.checkpoint import load_drafter

        _, state = load_drafter(path)
        apply_drafter_state(self.model, state)
        self.model.drafter_version = version

    def apply_order(self, order) -> dict:
        """Carry out a `SwapOrder`; never raises (the result says what happened)."""
        t0 = time.perf_counter()
        if self.tp_size != 1:
            return _result(
                order, t0, error="online swaps support tensor_parallel_size=1 only"
            )
        fetch = self._fetch
        if order.reason == "resume":
            fetch = self._receive(_Fetch(order.version), order)
            self._stage(fetch, budget_s=None)
        elif fetch is not None and fetch.thread.is_alive():
            # One fetch at a time on the channel (a newer order waits for it).
            return _result(order, t0, pending=True)
        elif fetch is None or fetch.version != order.version:
            # A newer version replaces a finished fetch of an older one.
            self._fetch = fetch = _Fetch(order.version)
            fetch.thread = threading.Thread(
                target=self._receive,
                args=(fetch, order),
                name="adaflash-fetch",
                daemon=True,
            )
            fetch.thread.start()
            return _result(order, t0, pending=True)
        elif (
            fetch.staged is None
            and fetch.error is None
            and not self._stage(fetch, budget_s=self._step_budget())
        ):
            return _result(order, t0, pending=True)
        self._fetch = None
        if fetch.error is not None or fetch.staged is None:
            return _result(order, t0, error=fetch.error or "fetch failed")
        written = time.perf_counter()
        try:
            write_staged(fetch.staged)
        except (RuntimeError, ValueError) as e:
            return _result(order, t0, error=str(e))
        now = time.perf_counter()
        if self.timeline is not None:
            self.timeline.append(("write", written, now, now - written))
        self.model.drafter_version = order.version
        return _result(
            order,
            t0,
            via=fetch.via,
            fetch_s=fetch.fetch_s,
            stall_s=max(now - t0, fetch.max_slice_s),
            staging={"stage_s": fetch.stage_s, "steps": fetch.stage_steps},
        )

    def _receive(self, fetch: _Fetch, order) -> _Fetch:
        """Fill `fetch.state` with the version's tensors (push, else its folder),
        or `fetch.error` with why it cannot be had."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        push = order.push
        if push and push.get("session") != self._push_broken_session:
            try:
                fetch.state = self.channel.fetch(
                    order.version, push["host"], push["port"], push["session"]
                )
                fetch.via = "push" if fetch.state is not None else "folder"
            except Exception as e:  # noqa: BLE001  (trainer gone: use the folder)
                self._push_broken_session = push.get("session")
                logger.warning(
                    "AdaFlash: push of version %d failed (%s); loading its folder",
                    order.version,
                    e,
                )
        try:
            if fetch.state is None:
                from adaflash_vllm.training.checkpoint import load_drafter

                _, fetch.state = load_drafter(order.path)
        except Exception as e:  # noqa: BLE001  (a background fetch must not die silently)
            fetch.state, fetch.error = None, f"{type(e).__name__}: {e}"
        if self.staging == "thread" and order.reason != "resume":
            self._stage(fetch, budget_s=None, record=False)
        fetch.fetch_s = time.perf_counter() - t0
        if self.timeline is not None:
            cpu = time.thread_time() - cpu0
            self.timeline.append(("fetch", t0, t0 + fetch.fetch_s, cpu))
        return fetch

    def _step_budget(self) -> float | None:
        return STAGE_BUDGET_S if self.staging == "slices" else None

    def _stage(
        self, fetch: _Fetch, *, budget_s: float | None, record: bool = True
    ) -> bool:
        """Run the received state's checks and staging for about `budget_s`
        (None: to the end). Returns True once it is staged or has failed.
        `record`: count the time as steps' (False in the fetch thread)."""
        if fetch.error is not None:
            return True
        t0 = time.perf_counter()
        try:
            if fetch.steps is None:
                fetch.steps = staging_steps(self.model, fetch.state)
            while budget_s is None or time.perf_counter() - t0 < budget_s:
                next(fetch.steps)
            done = False
        except StopIteration as finished:
            fetch.staged, fetch.state, done = finished.value, None, True
        except Exception as e:  # noqa: BLE001  (a bad version is a result, not a crash)
            fetch.state, fetch.error, done = None, f"{type(e).__name__}: {e}", True
        if not record:
            return done
        spent = time.perf_counter() - t0
        fetch.stage_s += spent
        fetch.stage_steps += 1
        fetch.max_slice_s = max(fetch.max_slice_s, spent)
        if self.timeline is not None:
            self.timeline.append(("stage", t0, t0 + spent, spent))
        return done


def _result(
    order,
    t0: float,
    *,
    error: str | None = None,
    pending: bool = False,
    via: str | None = None,
    fetch_s: float = 0.0,
    stall_s: float | None = None,
    staging: dict | None = None,
) -> dict:
    """What a worker reports for an order; `stall_s` is the longest any one step
    waited for this swap (default: this step, since `t0`)."""
    result = {
        "ok": error is None and not pending,
        "version": order.version,
        "stall_s": time.perf_counter() - t0 if stall_s is None else stall_s,
    }
    if staging is not None:
        result["staging"] = staging
    if pending:
        result["pending"] = True
    if error is not None:
        result["error"] = error
    if via is not None:
        result["via"], result["fetch_s"] = via, fetch_s
    return result
