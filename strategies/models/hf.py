"""A Hugging Face ``transformers`` causal LM behind the :class:`~strategies.models.base.CausalLM` interface."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM

__all__ = ["HFCausalLM"]

class HFCausalLM(CausalLM):
    """A ``transformers`` causal LM built from a config, behind the :class:`CausalLM` interface."""

    def __init__(self, config: dict[str, Any], seq: int = 1024) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency

        cfg = dict(config)
        model_type = cfg.pop("model_type")
        cfg.setdefault("max_position_embeddings", seq)
        self.hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
        layers = getattr(self.hf.config, "num_hidden_layers", None)
        # The decoder layers are the first ModuleList as long as the layer count (llama, gpt2, mistral, qwen...).
        found = [m for m in self.hf.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
        self.blocks = found[0] if found else nn.ModuleList()

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - HF runs its own blocks
        raise NotImplementedError

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`CausalLM.forward`; the loss is never sliced (HF models compute logits whole)."""
        if targets is None:
            return self.logits(idx)
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


