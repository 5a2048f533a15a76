"""Hot swap of drafter weights inside a running vLLM worker (in place, between steps).

vLLM's own reload paths break DFlash on CPU: linear weights are prepacked (the
`.weight` becomes an empty tensor) and `_fused_kv_weight` / `_k_norm_weights` are
copies built at load time. A swap therefore writes every drafter-owned tensor in
place, the fused K/V weight and stacked k-norms included (stable addresses, so CUDA
graphs that captured them stay valid), and gives each prepacked CPU linear new
packed weights. It runs in two parts: `stage_drafter_state` (in the fetch thread,
off the step: concatenations, dtype conversion and the CPU re-pack) and
`write_staged` (between steps: handle assignments and in-place copies only). The
embedding and lm_head are shared with the target and are never written: a state
that names them is rejected.

Checkpoint names (z-lab) -> vLLM modules, layer i:
    self_attn.{q,k,v}_proj -> self_attn.qkv_proj (rows q | k | v)
    mlp.{gate,up}_proj     -> mlp.gate_up_proj   (rows gate | up)
    everything else        -> the module of the same name
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

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
        if not torch.isfinite(state[key]).all():
            raise SwapRejected(f"{key}: NaN or inf values")


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


@torch.no_grad()
def stage_drafter_state(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> StagedState:
    """Prepare a validated `state` for `write_staged` (safe in a background
    thread: it reads the live model's layout, never its values)."""
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
        _stage_linear(attn.o_proj, state[p + "self_attn.o_proj.weight"], staged)
        _stage_copy(attn.q_norm.weight, state[p + "self_attn.q_norm.weight"], staged)
        _stage_copy(attn.k_norm.weight, state[p + "self_attn.k_norm.weight"], staged)
        _stage_linear(
            layer.mlp.gate_up_proj,
            torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
            ),
            staged,
        )
        _stage_linear(layer.mlp.down_proj, state[p + "mlp.down_proj.weight"], staged)
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


@dataclass
class _Fetch:
    """One version being fetched and checked off the step path."""

    version: int
    thread: threading.Thread | None = None
    state: dict[str, torch.Tensor] | None = None
    staged: StagedState | None = None
    via: str = "folder"
    error: str | None = None
    fetch_s: float = 0.0


class DrafterSwapper:
    """Worker side of online swaps: fetch a version (push, else its folder), check
    it, write it in place, record the version.

    Fetching and checking run in a background thread, so a step only pays for the
    in-place writes: the first order for a version starts the fetch and answers
    "pending" (the scheduler orders it again next step); an order that finds the
    fetch done writes the state. A resume at startup (no traffic yet) runs inline.

    Args:
        model: the live vLLM drafter (`AdaFlashDFlashForCausalLM`).
        push_timeout_s: bound on every wait for the trainer.
        backend: "gloo" on CPU, "nccl" on GPU.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        push_timeout_s: float,
        backend: str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        from adaflash_vllm.transport import WorkerChannel

        self.model = model
        self.tp_size = tp_size
        self.channel = WorkerChannel(
            rank=tp_rank, num_workers=tp_size, backend=backend, timeout_s=push_timeout_s
        )
        self._push_broken_session: str | None = None
        self._fetch: _Fetch | None = None

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
            fetch = self._fetch_and_check(_Fetch(order.version), order)
        elif fetch is not None and fetch.thread.is_alive():
            # One fetch at a time on the channel (a newer order waits for it).
            return _result(order, t0, pending=True)
        elif fetch is None or fetch.version != order.version:
            # A newer version replaces a finished fetch of an older one.
            self._fetch = fetch = _Fetch(order.version)
            fetch.thread = threading.Thread(
                target=self._fetch_and_check,
                args=(fetch, order),
                name="adaflash-fetch",
                daemon=True,
            )
            fetch.thread.start()
            return _result(order, t0, pending=True)
        self._fetch = None
        if fetch.error is not None or fetch.staged is None:
            return _result(order, t0, error=fetch.error or "fetch failed")
        try:
            write_staged(fetch.staged)
        except (RuntimeError, ValueError) as e:
            return _result(order, t0, error=str(e))
        self.model.drafter_version = order.version
        return _result(order, t0, via=fetch.via, fetch_s=fetch.fetch_s)

    def _fetch_and_check(self, fetch: _Fetch, order) -> _Fetch:
        """Fill `fetch` with the version's checked state (push, else its folder),
        or with the error that makes it unusable."""
        t0 = time.perf_counter()
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
            validate_state(self.model, fetch.state)
            fetch.staged = stage_drafter_state(self.model, fetch.state)
            fetch.state = None  # the staged tensors are all a swap needs now
        except Exception as e:  # noqa: BLE001  (a background fetch must not die silently)
            fetch.state, fetch.staged = None, None
            fetch.error = f"{type(e).__name__}: {e}"
        fetch.fetch_s = time.perf_counter() - t0
        return fetch


def _result(
    order,
    t0: float,
    *,
    error: str | None = None,
    pending: bool = False,
    via: str | None = None,
    fetch_s: float = 0.0,
) -> dict:
    """What a worker reports for an order; `stall_s` is the time the step waited."""
    result = {
        "ok": error is None and not pending,
        "version": order.version,
        "stall_s": time.perf_counter() - t0,
    }
    if pending:
        result["pending"] = True
    if error is not None:
        result["error"] = error
    if via is not None:
        result["via"], result["fetch_s"] = via, fetch_s
    return result
