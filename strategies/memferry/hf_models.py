"""Hugging Face models given straight to MemFerry: no KV cache, losses through ``labels=``, and
weights written back out as a ``save_pretrained`` folder (:func:`save_hf_folder`)."""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["no_kv_cache", "kv_cache_off", "takes_labels", "model_loss", "head_shape", "tied_names", "save_hf_folder"]


def no_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's KV cache (training never reuses it, and a DynamicCache
    in the outputs would reach the profiler and the blocks' hooks)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


@contextlib.contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[None]:
    """:func:`no_kv_cache` for the duration only: the config's ``use_cache`` is put back after
    (profiling a model the caller keeps: a cache filled by one timed forward would carry its
    graph into the next)."""
    config = getattr(model, "config", None)
    was = getattr(config, "use_cache", None)
    no_kv_cache(model)
    try:
        yield
    finally:
        if was is not None:
            config.use_cache = was


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``labels=`` (Hugging Face models computing their own loss)."""
    try:
        if "labels" in inspect.signature(model.forward).parameters:
            return True
    except (TypeError, ValueError):
        return False
    # A PEFT model's forward is a bare (*args, **kwargs) wrapper: ask the model it wraps.
    base = getattr(model, "get_base_model", None)
    inner = base() if callable(base) else None
    return isinstance(inner, nn.Module) and inner is not model and takes_labels(inner)


def model_loss(model: Any, inputs: Any, targets: Any, labels_model: nn.Module | None = None) -> torch.Tensor:
    """The loss of a model that computes its own: ``model(inputs, labels=targets).loss`` for a
    model taking ``labels`` (judged on ``labels_model``, default ``model``), else ``model(inputs, targets)``.
    For the former ``inputs`` may be a mapping of its keyword arguments (``input_ids``,
    ``attention_mask``, ...: a padded batch as a collator makes it), passed as such."""
    if takes_labels(labels_model if labels_model is not None else model):
        out = model(**inputs, labels=targets) if isinstance(inputs, Mapping) else model(inputs, labels=targets)
        return out["loss"] if isinstance(out, dict) else out.loss
    return model(inputs, targets)


def head_shape(model: nn.Module) -> tuple[int, int]:
    """``(vocab, hidden)`` of the model's output head: ``model.head`` (our ``CausalLM``, and
    ``HFCausalLM``'s output embedding) or a Hugging Face model's ``get_output_embeddings()``;
    ``(0, 0)`` where there is no such linear."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0, 0
    return int(weight.shape[0]), int(weight.shape[1])


def tied_names(model: nn.Module) -> set[str]:
    """Parameter names that are a second name of another parameter (a tied ``lm_head.weight``):
    ``named_parameters()`` and the engine's state list a tied weight once, under its first name."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}


def save_hf_folder(model: nn.Module, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                   **kwargs: Any) -> Path:
    """``model.save_pretrained(out_dir)`` (safetensors; a PEFT model writes its adapter) with
    ``use_cache`` on in the written config, as a loaded model expects for generation (training
    turned it off: :func:`no_kv_cache`); the model's own config is left as it was.

    ``state_dict`` (by the model's parameter names; a tied weight once) is written instead of the
    model's own tensors; ``save_pretrained`` writes a tied weight once and ``from_pretrained`` ties it
    again. ``kwargs`` go to ``save_pretrained``.
    """
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    before = getattr(config, "use_cache", None)
    if before is not None:
        config.use_cache = True
    try:
        model.save_pretrained(out, state_dict=state_dict, **kwargs)
    finally:
        if before is not None:
            config.use_cache = before
    return out
