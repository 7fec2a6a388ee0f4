"""The compute dtype of a MemFerry model: fp32 parameters cast to it, their fp32 values kept as masters.

The engine casts before anything reads the model (the profiler measures it in its compute
dtype) and hands the fp32 originals to the shadow model as masters; the planner casts for
its profiled step and restores the originals after.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_compute_dtype", "cast_parameters", "restore_parameters"]


def check_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Refuse a ``compute_dtype`` that is not a floating dtype, or a model it does not apply to."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    other = sorted({str(p.dtype) for p in model.parameters() if p.dtype not in (torch.float32, dtype)})
    if other:
        raise ValueError(f"compute_dtype={dtype} needs fp32 (or {dtype}) parameters, found {', '.join(other)}; "
                         f"build the model in fp32, or leave compute_dtype out to compute in the parameters' dtype")


def cast_parameters(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast floating parameters (frozen ones too: they share their unit's flat buffer) to
    ``dtype``; their original tensors by name."""
    originals: dict[str, torch.Tensor] = {}
    if dtype is None:
        return originals
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype:
            originals[name] = p.data
            p.data = p.data.to(dtype)
    return originals


def restore_parameters(model: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Undo :func:`cast_parameters` for the parameters whose originals are still held."""
    for name, p in model.named_parameters():
        if name in originals:
            p.data = originals[name]
