"""The adaptive length head: predicts, per drafted block, the fraction of its K
drafts the target will accept, from the drafter's own hidden states.

    x     = [mean_k h_k ; h_K]                    h: drafter outputs at the K masks
    z     = silu(W1 x + b1);  z = z + silu(W2 z + b2)
    a_hat = sigmoid(w3 z + b3)                    in [0, 1]

(the AdaFlash "two-model" threshold head). It runs in fp32 on detached hidden
states, so it never changes the drafter or its drafts. Weights `length_head.*` live
in `length_head.safetensors` next to the drafter; `model.safetensors.index.json`
lists only the drafter's own file, so stock vLLM loads such a checkpoint unchanged.
The drafter's `dflash_config` names the head: `thresh_head_bottleneck_dim` (and
`use_thresh_head_two_model: true`, the AdaFlash-SGLang keys).

Shape symbols: B blocks, K drafts per block, H drafter hidden size, D bottleneck.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from adaflash_vllm.training.checkpoint import HEAD_FILE
from safetensors.torch import load_file
from torch import nn

CONFIG_KEY = "thresh_head_bottleneck_dim"


class LengthHead(nn.Module):
    """a_hat [B] from drafter hidden states [B, K, H]."""

    def __init__(self, hidden_size: int, bottleneck: int = 64):
        super().__init__()
        self.hidden_size, self.bottleneck = hidden_size, bottleneck
        self.proj = nn.Linear(2 * hidden_size, bottleneck)
        self.mid = nn.Linear(bottleneck, bottleneck)
        self.out = nn.Linear(bottleneck, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(hidden))

    def logit(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        x = torch.cat([h.mean(dim=-2), h[..., -1, :]], dim=-1)
        z = F.silu(self.proj(x))
        z = z + F.silu(self.mid(z))
        return self.out(z).squeeze(-1)


def head_config(drafter_cfg: dict) -> int | None:
    """The head's bottleneck size from a drafter config, or None (no head)."""
    value = (drafter_cfg.get("dflash_config") or {}).get(CONFIG_KEY)
    return int(value) if value else None


def load_length_head(
    folder: str | Path, drafter_cfg: dict | None = None
) -> LengthHead | None:
    """The head stored with a drafter, or None when it has none.

    Raises:
        ValueError: the head's input size does not fit the drafter's hidden size.
    """
    folder = Path(folder)
    if drafter_cfg is None:
        drafter_cfg = json.loads((folder / "config.json").read_text())
    bottleneck = head_config(drafter_cfg)
    if bottleneck is None or not (folder / HEAD_FILE).exists():
        return None
    state = {
        k.removeprefix("length_head."): v
        for k, v in load_file(str(folder / HEAD_FILE)).items()
    }
    hidden = drafter_cfg["hidden_size"]
    in_features = state["proj.weight"].shape[1]
    if in_features != 2 * hidden or state["proj.weight"].shape[0] != bottleneck:
        raise ValueError(
            f"length head in {folder} expects input {in_features} / bottleneck "
            f"{state['proj.weight'].shape[0]}, but the drafter has hidden size "
            f"{hidden} "
            f"(input {2 * hidden}) and {CONFIG_KEY}={bottleneck}"
        )
    head = LengthHead(hidden, bottleneck)
    head.load_state_dict(state)
    return head.eval()


def acceptance_labels(
    accepted: torch.Tensor, valid_slots: torch.Tensor
) -> torch.Tensor:
    """Realised acceptance ratio of each block over its full K (not a truncated
    prefix): accepted drafts / valid slots, [B]."""
    return accepted.float() / valid_slots.float().clamp_min(1)


def calibration(pred: torch.Tensor, real: torch.Tensor, bins: int = 10) -> dict:
    """MAE and expected calibration error (equal-width bins) of predicted vs
    realised acceptance ratios."""
    pred, real = pred.float().flatten(), real.float().flatten()
    if pred.numel() == 0:
        return {"mae": float("nan"), "ece": float("nan"), "n": 0}
    idx = (pred.clamp(0, 1 - 1e-6) * bins).long()
    ece = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            ece += sel.float().mean().item() * abs(
                pred[sel].mean().item() - real[sel].mean().item()
            )
    return {
        "mae": (pred - real).abs().mean().item(),
        "ece": ece,
        "n": pred.numel(),
        "mae_constant": (real - real.mean()).abs().mean().item(),
    }
