"""The adaptive length head: predicts, per drafted block, how many of its K drafts
the target will accept, from the drafter's hidden states and its own confidence.

Two kinds, named by the drafter's `dflash_config.length_head_kind`:

`survival` (the default for new heads):

    x   = [mean_k h_k ; h_K ; c_1..c_K]      c_k = (log p_k, margin_k, entropy_k)
    z   = silu(W1 x + b1);  z = z + silu(W2 z + b2)
    g_k = sigmoid(W3 z + b3)_k               P(draft k accepted | drafts < k were)
    s_j = prod_{k <= j} g_k                  survival: P(at least j accepted)
    a_hat = (1/K) sum_j s_j                  expected accepted fraction

where p_k is the drafter's top-1 probability at slot k, margin_k the gap between
its two largest logits and entropy_k that of its distribution (`draft_confidence`).
A head with `dflash_config.length_head_history: true` also reads the request's
previous round, x = [... ; u, u a'/K, u [a' = k']]: u = 1 when that round verified
k' >= 1 drafts (0 on a request's first round, after a step without a draft, and
on blocks trained without one), of which it accepted a'. Acceptance runs in
stretches (a fully accepted round is followed by long ones, a rejected first
draft by short ones), which the block alone does not show; a' = k' < K says the
round was cut short by its budget, so a' is a lower bound.
Trained by the exact likelihood of the realised accepted length (training/head.py),
so the survival curve itself is calibrated, not only its mean; the budgets read it
directly.

`ratio` (the first AdaFlash heads, and the paper's "two-model" threshold head):

    x = [mean_k h_k ; h_K];  same MLP;  a_hat = sigmoid(w3 z + b3)

with a geometric survival of the same expected length (budget.py).

The head runs in fp32 on detached inputs, so it never changes the drafter or its
drafts. Weights `length_head.*` live in `length_head.safetensors` next to the
drafter; `model.safetensors.index.json` lists only the drafter's own file, so stock
vLLM loads such a checkpoint unchanged. `dflash_config.thresh_head_bottleneck_dim`
(the AdaFlash-SGLang key) names the bottleneck D.

Shape symbols: B blocks, K drafts per block, H drafter hidden size, D bottleneck,
V vocabulary, C = 3 confidence features per slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from adaflash_vllm.proposers.row_max import top_two
from adaflash_vllm.training.checkpoint import HEAD_FILE
from safetensors.torch import load_file
from torch import nn

CONFIG_KEY = "thresh_head_bottleneck_dim"
KIND_KEY = "length_head_kind"
HISTORY_KEY = "length_head_history"
KINDS = ("survival", "ratio")
CONFIDENCE_FEATURES = 3
HISTORY_FEATURES = 3  # u, u a'/K, u [a' = k'] (module docstring)
_MARGIN_CAP = 30.0  # logits gaps past this say nothing more; keeps inputs bounded
_LOGP_FLOOR = -30.0
HIDDEN_DROPOUT = 0.5


# Elements per chunk of rows: on a CPU a chunk that stays in the core's cache
# (1 MiB of fp32) makes each pass over it cheap; on an accelerator, large chunks
# keep the launches few and still bound the fp32 temporaries (~128 MiB each).
_CHUNK_ELEMENTS = {"cpu": 1 << 18}
_CHUNK_ELEMENTS_DEFAULT = 1 << 25
_Z_FLOOR = -80.0  # logits this far below the top add nothing to p or entropy


def draft_confidence(logits: torch.Tensor) -> torch.Tensor:
    """Per-slot confidence features [..., 3] from drafter logits [..., V]:
    (log p_top1, top1 - top2 logit margin, entropy), in fp32.

    With z = x - max(x) (clamped at -80, where exp underflows) and s = sum e^z:
    log p_top1 = -log s and entropy = log s - sum(e^z z) / s, so one exp pass
    gives both. Rows go in chunks sized to the device (`_CHUNK_ELEMENTS`), so a
    150k vocabulary never needs gigabytes of temporaries."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], CONFIDENCE_FEATURES, device=logits.device)
    budget = _CHUNK_ELEMENTS.get(logits.device.type, _CHUNK_ELEMENTS_DEFAULT)
    step = max(1, budget // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        x = flat[start : start + step].float()
        top2 = top_two(x)
        z = (x - top2[:, :1]).clamp_min_(_Z_FLOOR)
        e = z.exp()
        total = e.sum(-1)
        log_total = total.log()
        rows = out[start : start + x.shape[0]]
        rows[:, 0] = (-log_total).clamp_min(_LOGP_FLOOR)
        rows[:, 1] = (top2[:, 0] - top2[:, 1]).clamp(0.0, _MARGIN_CAP)
        rows[:, 2] = log_total - torch.linalg.vecdot(e, z) / total
    return out.view(*logits.shape[:-1], CONFIDENCE_FEATURES)


class LengthHead(nn.Module):
    """Acceptance of a drafted block from drafter hidden states [B, K, H] and, for
    the `survival` kind, confidence features [B, K, 3] (`draft_confidence`) and,
    with `history`, the previous round's features [B, 3] (`round_history`).

    Args:
        hidden_size: the drafter's hidden size H.
        bottleneck: D.
        num_drafts: K; required for (and only used by) the `survival` kind.
        kind: "survival" or "ratio" (module docstring).
        history: read the request's previous round (survival kind only).

    Example:
        >>> head = LengthHead(256, 64, num_drafts=7)
        >>> s = head.survival(hidden, draft_confidence(logits))  # [B, 7]
    """

    def __init__(
        self,
        hidden_size: int,
        bottleneck: int = 64,
        *,
        num_drafts: int | None = None,
        kind: str = "survival",
        history: bool = False,
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"length head kind {kind!r}; valid: {', '.join(KINDS)}")
        if kind == "survival" and not num_drafts:
            raise ValueError("a survival length head needs num_drafts (K)")
        if history and kind != "survival":
            raise ValueError(f"{HISTORY_KEY} needs a survival length head")
        self.kind, self.hidden_size, self.bottleneck = kind, hidden_size, bottleneck
        self.num_drafts = num_drafts if kind == "survival" else None
        self.history = history
        extra = CONFIDENCE_FEATURES * num_drafts if kind == "survival" else 0
        extra += HISTORY_FEATURES if history else 0
        self.proj = nn.Linear(2 * hidden_size + extra, bottleneck)
        self.mid = nn.Linear(bottleneck, bottleneck)
        self.out = nn.Linear(bottleneck, num_drafts if kind == "survival" else 1)
        # Training only: drop pooled hidden inputs so the head leans on the
        # confidence features too, which carry over to domains it never saw.
        self.hidden_dropout = nn.Dropout(HIDDEN_DROPOUT if kind == "survival" else 0)

    @property
    def needs_confidence(self) -> bool:
        return self.kind == "survival"

    def forward(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """a_hat [B]: the predicted accepted fraction of the K drafts."""
        return self.ratio(hidden, confidence, history)

    def ratio(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.kind == "ratio":
            return torch.sigmoid(self.logits(hidden).squeeze(-1))
        return self.survival(hidden, confidence, history).mean(-1)

    def survival(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """s [B, K] = P(at least j drafts accepted), non-increasing in j (survival
        kind only; budget.py derives a geometric one for the ratio kind)."""
        if self.kind != "survival":
            raise TypeError("a ratio length head predicts a_hat only")
        return torch.sigmoid(self.logits(hidden, confidence, history)).cumprod(-1)

    def logits(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, K] conditional acceptance logits (survival) or [B, 1] (ratio)."""
        return self.mlp(self.inputs(hidden, confidence, history))

    def inputs(
        self,
        hidden: torch.Tensor,
        confidence: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, 2H (+ 3K) (+ 3)]: pooled hidden states (+ the confidence
        features) (+ the previous round's; None reads as "no previous round").
        A head without `history` ignores it."""
        h = hidden.float()
        parts = [h.mean(dim=-2), h[..., -1, :]]
        if self.kind == "survival":
            if confidence is None:
                raise ValueError("a survival length head needs confidence features")
            if confidence.shape[-2] != self.num_drafts:
                raise ValueError(
                    f"length head trained for K={self.num_drafts} drafts, got "
                    f"{confidence.shape[-2]}"
                )
            parts.append(confidence.float().flatten(-2))
        if self.history:
            if history is None:
                history = h.new_zeros(*h.shape[:-2], HISTORY_FEATURES)
            parts.append(history.float())
        return torch.cat(parts, dim=-1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from `inputs` x [B, F]."""
        pooled = 2 * self.hidden_size
        x = torch.cat([self.hidden_dropout(x[..., :pooled]), x[..., pooled:]], dim=-1)
        z = F.silu(self.proj(x))
        z = z + F.silu(self.mid(z))
        return self.out(z)


def head_config(drafter_cfg: dict) -> int | None:
    """The head's bottleneck size from a drafter config, or None (no head)."""
    value = (drafter_cfg.get("dflash_config") or {}).get(CONFIG_KEY)
    return int(value) if value else None


def head_kind(drafter_cfg: dict) -> str:
    """The head's kind; checkpoints from before `length_head_kind` hold a ratio
    head."""
    kind = (drafter_cfg.get("dflash_config") or {}).get(KIND_KEY, "ratio")
    if kind not in KINDS:
        raise ValueError(
            f"dflash_config.{KIND_KEY} is {kind!r}; valid: {', '.join(KINDS)}"
        )
    return kind


def head_history(drafter_cfg: dict) -> bool:
    """Whether the head reads the previous round (`length_head_history`)."""
    value = (drafter_cfg.get("dflash_config") or {}).get(HISTORY_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(f"dflash_config.{HISTORY_KEY} is {value!r}; use true or false")
    return value


def make_length_head(drafter_cfg: dict) -> LengthHead | None:
    """A fresh head shaped as a drafter config (hidden_size, block_size,
    dflash_config) names it, or None when it names none."""
    bottleneck = head_config(drafter_cfg)
    if bottleneck is None:
        return None
    kind = head_kind(drafter_cfg)
    return LengthHead(
        drafter_cfg["hidden_size"],
        bottleneck,
        num_drafts=int(drafter_cfg.get("block_size", 16)) - 1,
        kind=kind,
        history=head_history(drafter_cfg),
    )


def round_history(
    accepted: torch.Tensor, verified: torch.Tensor, num_drafts: int
) -> torch.Tensor:
    """History features [B, 3] (module docstring) from each request's previous
    round: `verified` drafts k' [B] (0: none, or no such round) of which
    `accepted` a' [B] were accepted (clamped to k')."""
    k = verified.float()
    u = (k > 0).float()
    a = torch.minimum(accepted.float().clamp_min(0), k)
    return torch.stack([u, u * a / num_drafts, u * (a == k).float()], dim=-1)


def load_length_head(
    folder: str | Path, drafter_cfg: dict | None = None
) -> LengthHead | None:
    """The head stored with a drafter, or None when it has none.

    Raises:
        ValueError: the stored head's shapes do not fit the drafter (hidden size,
            K = block_size - 1, bottleneck, kind).
    """
    folder = Path(folder)
    if drafter_cfg is None:
        drafter_cfg = json.loads((folder / "config.json").read_text())
    head = make_length_head(drafter_cfg)
    if head is None or not (folder / HEAD_FILE).exists():
        return None
    state = {
        k.removeprefix("length_head."): v
        for k, v in load_file(str(folder / HEAD_FILE)).items()
    }
    want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        raise ValueError(
            f"length head in {folder} has shapes {got}, but a {head.kind} head for "
            f"this drafter (hidden size {head.hidden_size}, K = "
            f"{head.num_drafts or 'any'}, {CONFIG_KEY}={head.bottleneck}, "
            f"{HISTORY_KEY}={str(head.history).lower()}) has {want}"
        )
    head.load_state_dict(state)
    return head.eval()


def acceptance_labels(
    accepted: torch.Tensor, valid_slots: torch.Tensor
) -> torch.Tensor:
    """Realised acceptance ratio of each block over its full K (not a truncated
    prefix): accepted drafts / valid slots, [B]."""
    return accepted.float() / valid_slots.float().clamp_min(1)


def ece_bin_sums(
    pred: torch.Tensor, real: torch.Tensor, bins: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per equal-width bin of the predicted mean: (sum of predictions, sum of
    realised ratios) [bins]. ECE = sum_b |pred_b - real_b| / N; the sums add up
    over batches and ranks."""
    pred, real = pred.float().flatten(), real.float().flatten()
    idx = (pred.clamp(0, 1 - 1e-6) * bins).long()
    return (
        torch.bincount(idx, weights=pred, minlength=bins),
        torch.bincount(idx, weights=real, minlength=bins),
    )


def calibration(
    pred: torch.Tensor,
    real: torch.Tensor,
    bins: int = 10,
    *,
    median: torch.Tensor | None = None,
) -> dict:
    """Calibration of predicted vs realised acceptance ratios.

    `pred` is the predicted mean (expected accepted fraction), `median` the
    median of the same prediction. Under absolute error the best point forecast
    is the median, so `mae` scores `median` when given, and `mae_constant` the
    best constant forecast (the realised median); `mae_mean` and
    `mae_constant_mean` score the means. ECE (equal-width bins) is the
    calibration of the mean."""
    pred, real = pred.float().flatten(), real.float().flatten()
    if pred.numel() == 0:
        return {"mae": float("nan"), "ece": float("nan"), "n": 0}
    pred_sums, real_sums = ece_bin_sums(pred, real, bins)
    ece = (pred_sums - real_sums).abs().sum().item() / pred.numel()
    mae_mean = (pred - real).abs().mean().item()
    out = {
        "mae": mae_mean,
        "mae_mean": mae_mean,
        "ece": ece,
        "n": pred.numel(),
        "mae_constant": (real - real.median()).abs().mean().item(),
        "mae_constant_mean": (real - real.mean()).abs().mean().item(),
    }
    if median is not None:
        out["mae"] = (median.float().flatten() - real).abs().mean().item()
    return out
