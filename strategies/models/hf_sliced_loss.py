"""A Hugging Face causal LM whose training loss runs over token slices, without whole logits.

A ``transformers`` causal LM computes every token's logits, upcasts them to fp32 and then takes
the cross-entropy: at Qwen2-1.5B's vocabulary (151936) and 4 × 2048 tokens that is 2.5 GB of bf16
logits and 5 GB for each fp32 tensor the loss makes and keeps for backward, most of a 16 GB
device. After :func:`slice_hf_loss`, the model's training forward with ``labels`` computes the same
loss as its ``ForCausalLMLoss`` (labels shifted left, -100 ignored, the mean over counted tokens,
or the sum over ``num_items_in_batch`` where Trainer gives it) from the decoder's final hidden
states, through the output embedding, in ``chunks`` token slices whose gradients are made in
forward (:mod:`.sliced_loss`): no slice's logits outlive it, and the head runs once per slice.
The same loss up to summation order. A model that maps its logits after the output embedding
does so on each slice as it would on the whole: Gemma 2/3's soft cap (``final_logit_softcapping``),
Cohere's ``logit_scale``, Granite's ``logits_scaling``. Without labels the model's own forward runs, and so it does
without gradients (Trainer's evaluation, which may read the logits) unless ``eval_logits=False``:
then the loss alone, over slices, for a loss-only evaluation (``TrainingArguments(
prediction_loss_only=True)``) that must fit where training does.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .sliced_loss import sliced_loss_sum, summed_slices

__all__ = ["slice_hf_loss", "logit_map"]

IGNORE = -100  # ForCausalLMLoss's ignore_index


def slice_hf_loss(model: nn.Module, chunks: int, eval_logits: bool = True) -> nn.Module:
    """Make ``model`` (a ``transformers`` causal LM, or a peft model around one) compute its
    training loss over ``chunks`` token slices (see the module docstring); returns ``model``.
    ``eval_logits=False``: without gradients too, and then the output has no logits.

    Checked first, on four tokens: the model's logits must be its output embedding of the
    decoder's final hidden states, mapped as its config says (soft cap, scale; see the module
    docstring), bit for bit; a model mapping them otherwise is refused, as is one whose loss is
    not ``ForCausalLMLoss``.

    Raises:
        ValueError: ``chunks`` below 1, or a model this cannot slice (the message says which).
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer (token slices of the loss), got {chunks!r}")
    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    _check_sliceable(lm)
    lm.loss_chunks, lm.sliced_eval_logits = chunks, bool(eval_logits)
    lm.forward = types.MethodType(_sliced_forward, lm)  # peft's forward calls this one too
    return model


def _check_sliceable(lm: nn.Module) -> None:
    name = type(lm).__name__
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or not isinstance(getattr(lm, "base_model", None), nn.Module) or lm.base_model is lm:
        raise ValueError(f"{name} is not a Hugging Face causal LM with a linear output embedding: give the "
                         f"*ForCausalLM model (or a peft model around one)")
    loss_fn = getattr(lm, "loss_function", None)
    if getattr(loss_fn, "__name__", None) != "ForCausalLMLoss":
        raise ValueError(f"{name}'s loss is {getattr(loss_fn, '__name__', loss_fn)!r}, not ForCausalLMLoss: "
                         f"its loss cannot be sliced here; train it unsliced")
    logit_map(lm)  # an unknown mapping is refused by name before the comparison
    # Token ids 1-4 (0 is often padding, whose zero embedding could hide a cap)
    ids = (torch.arange(1, 5, device=head.weight.device) % head.weight.shape[0]).unsqueeze(0)
    was_training = lm.training
    try:
        lm.eval()
        with torch.no_grad():
            own = lm(input_ids=ids, use_cache=False).logits
            ours = logit_map(lm)(head(lm.base_model(input_ids=ids, use_cache=False).last_hidden_state))
    finally:
        lm.train(was_training)
    if not torch.equal(own, ours):
        raise ValueError(f"{name} changes its logits after the output embedding in a way not known here: the sliced "
                         f"loss would differ from its own; train it unsliced")


def logit_map(lm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``lm`` (a ``transformers`` causal LM) does to its output embedding's logits, as its
    forward does it, op for op (the identity for most models).

    Raises:
        ValueError: more than one mapping configured (no model known here composes them).
    """
    cfg = getattr(lm, "config", None)
    cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2 / 3
    scale = getattr(lm, "logit_scale", getattr(cfg, "logit_scale", None))  # Cohere: an attribute of the model
    divisor = getattr(cfg, "logits_scaling", None)  # Granite
    maps = {"final_logit_softcapping": None if cap is None else lambda z: torch.tanh(z / cap) * cap,
            "logit_scale": None if scale in (None, 1, 1.0) else lambda z: z * scale,
            "logits_scaling": None if divisor in (None, 1, 1.0) else lambda z: z / divisor}
    active = {k: f for k, f in maps.items() if f is not None}
    if len(active) > 1:
        raise ValueError(f"{type(lm).__name__} sets {sorted(active)} together: the sliced loss knows each alone; "
                         f"train it unsliced")
    return next(iter(active.values()), lambda z: z)


def _sliced_forward(self: nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                    **kwargs: Any) -> Any:
    """The model's forward, with the loss over ``self.loss_chunks`` token slices."""
    grad = torch.is_grad_enabled()
    if labels is None or (not grad and self.sliced_eval_logits):
        return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    shifted = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    h = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
    if shifted is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
        shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    h, t = h.reshape(-1, h.shape[-1]), shifted.reshape(-1).to(h.device)
    if num_items is None:
        denominator = (t != IGNORE).sum().clamp(min=1)
    else:
        denominator = torch.as_tensor(num_items, device=h.device)
    head, mapped = self.get_output_embeddings(), logit_map(self)

    def slice_loss(hs: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(mapped(head(hs)).float(), ts, ignore_index=IGNORE, reduction="sum")

    if grad:
        total = sliced_loss_sum(slice_loss, head, h, t, self.loss_chunks, denominator)
    else:
        total = summed_slices(slice_loss, h, t, self.loss_chunks)
    return CausalLMOutputWithPast(loss=total / denominator)
