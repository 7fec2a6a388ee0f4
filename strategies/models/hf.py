"""A Hugging Face ``transformers`` causal LM behind the :class:`~strategies.models.base.CausalLM` interface.

Built from a ``config`` (random init) or loaded from a local ``path`` (a ``save_pretrained``
folder, weights from its safetensors; never downloaded), optionally wrapped with peft LoRA
adapters (``lora``: base weights frozen). :meth:`HFCausalLM.features` and :attr:`HFCausalLM.head`
split the HF model into its base model and output embedding, so :class:`CausalLM`'s loss over
token slices (``loss_chunks``) works: no whole fp32 logits. Logits the model maps after its
output embedding (Gemma 2's soft cap, Cohere's and Granite's scales) are mapped on each slice
as its own forward maps them (:func:`~.hf_sliced_loss.logit_map`).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM
from .hf_config import LORA_DEFAULTS
from .hf_sliced_loss import logit_map

__all__ = ["HFCausalLM"]


def _lora_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig, TaskType

    lo = {**LORA_DEFAULTS, **lora}
    return LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=float(lo["dropout"]),
                      target_modules=lo["target_modules"], task_type=TaskType.CAUSAL_LM)


class HFCausalLM(CausalLM):
    """A ``transformers`` causal LM (from ``config`` or a local ``path``, optional LoRA) as a :class:`CausalLM`.

    Attributes:
        hf: the ``transformers`` model, or the peft ``PeftModel`` around it when ``lora`` is given.
        blocks: the decoder layers' ``ModuleList``.
    """

    def __init__(self, config: dict[str, Any] | None = None, seq: int = 1024, path: str | None = None,
                 lora: dict[str, Any] | None = None) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency

        if path is not None:
            if torch.get_default_device().type == "meta":  # counting parameters: the structure only
                hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
                self.hf = AutoModelForCausalLM.from_config(hf_config)
            else:
                self.hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                               dtype=torch.get_default_dtype())
        else:
            cfg = dict(config or {})
            model_type = cfg.pop("model_type")
            cfg.setdefault("max_position_embeddings", seq)
            self.hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
        self.hf.config.use_cache = False  # training: no key/value cache
        if lora is not None:
            from peft import get_peft_model

            with warnings.catch_warnings():
                # peft reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning
                # in every LoRA run that the user can do nothing about); only that one is hidden.
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                self.hf = get_peft_model(self.hf, _lora_config(lora))  # freezes every non-adapter weight
        layers = getattr(self.base.config, "num_hidden_layers", None)
        # The decoder layers are the first ModuleList as long as the layer count (llama, gpt2, mistral, qwen...).
        found = [m for m in self.hf.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
        # Kept out of the registered submodules: the layers are already ``hf``'s, and a second
        # registration would repeat every layer under ``blocks.*`` in state dicts and exports.
        self.__dict__["blocks"] = found[0] if found else nn.ModuleList()
        self.__dict__["_logit_map"] = logit_map(self.base)  # a plain callable, not a submodule
        self.recompute = self._recompute  # applied now that the HF model exists

    @property
    def recompute(self) -> bool:
        """Recompute each decoder layer in backward: the HF model's own gradient checkpointing (non-reentrant)."""
        return getattr(self, "_recompute", False)

    @recompute.setter
    def recompute(self, value: bool) -> None:
        self._recompute = bool(value)
        if "hf" not in self._modules:  # CausalLM.__init__ sets it before the HF model exists
            return
        base = self.base
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x names; the gradient_* ones are deprecated
            if value:
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            elif base.is_activation_checkpointing:
                base.activation_checkpointing_disable()
        elif value:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif base.is_gradient_checkpointing:
            base.gradient_checkpointing_disable()

    @property
    def base(self) -> nn.Module:
        """The ``transformers`` causal LM itself (inside the peft wrapper if there is one)."""
        get_base = getattr(self.hf, "get_base_model", None)
        return get_base() if callable(get_base) and self.hf.__class__.__module__.startswith("peft") else self.hf

    @property
    def head(self) -> nn.Module:
        """The output embedding (``lm_head``), which maps :meth:`features` to logits."""
        return self.base.get_output_embeddings()

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """The base model's final (normalised) hidden states, ``(batch, seq, hidden)``."""
        return self.base.base_model(input_ids=idx, use_cache=False).last_hidden_state

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - HF runs its own blocks
        raise NotImplementedError

    def _slice_loss_sum(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._logit_map(self.head(h)).float(), t, reduction="sum")

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The HF model's own logits (its forward, not features + head)."""
        return self.hf(input_ids=idx, use_cache=False).logits
