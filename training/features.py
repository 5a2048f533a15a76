"""Target features for drafter training, equal to what vLLM feeds the drafter.

vLLM's Qwen2/Qwen3 forward hands the drafter `hidden_states + residual` after each
tapped decoder layer: the *pre-norm* residual stream. transformers 5.x swaps the
last entry of `output_hidden_states` for the normed `last_hidden_state`, so reading
that tuple is wrong for the last layer; we read each tapped layer's output with a
forward hook instead, which is the residual stream for every layer alike.

Shape symbols: B sequences, N tokens, T tapped layers, H hidden, V vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

SUPPORTED_TARGETS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


class TargetModel:
    """A frozen HF causal LM that returns drafter features and logits.

    Args:
        path: the target's folder (HF format).
        dtype: compute dtype (float32 on CPU keeps parity with vLLM tests).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        import json

        from transformers import AutoModelForCausalLM

        cfg = json.loads((Path(path) / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_TARGETS:
            from adaflash_vllm.errors import AdaFlashConfigError

            raise AdaFlashConfigError(
                f"target {path} has architecture {arch}; the AdaFlash trainer supports "
                f"{', '.join(SUPPORTED_TARGETS)} (Qwen3-style decoders)."
            )
        self.path = str(path)
        self.config = cfg
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        self.model.eval().requires_grad_(False)
        self.device = torch.device(device)

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @contextmanager
    def _tap(self, layer_ids: list[int]):
        captured: dict[int, torch.Tensor] = {}
        handles = []
        layers = self.model.model.layers
        for lid in layer_ids:

            def hook(_m, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, tuple) else out

            handles.append(layers[lid].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,  # [B, N]
        layer_ids: list[int],
        attention_mask: torch.Tensor | None = None,  # [B, N], 1 = real token
        *,
        with_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features [B, N, T*H], logits [B, N, V] or None), right-padded batches."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            from adaflash_vllm.errors import DrafterMismatchError

            raise DrafterMismatchError(
                f"target_layer_ids {layer_ids} outside the target's "
                f"{self.num_layers} layers"
            )
        with self._tap(layer_ids) as captured:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=None
                if attention_mask is None
                else attention_mask.to(self.device),
                use_cache=False,
                logits_to_keep=0 if with_logits else 1,
            )
        feats = torch.cat([captured[i] for i in layer_ids], dim=-1)
        return feats, (out.logits if with_logits else None)
