"""What a block's backward allocates beyond what its forward left, measured (the profiler's
``bwd_extra_bytes``, ``bwd_recompute_bytes`` and ``bwd_selective_bytes``)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from xpu import Backend

__all__ = ["backward_extra", "recomputed_backward_extra"]


def backward_extra(backend: Backend, device: int, outs: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """(peak device bytes the block's first backward from ``outs`` allocates, its output
    gradients included (the block after it made them, and they live through it); those
    gradients, random, for the timed rounds). The first backward: its weights' gradients are new too."""
    backend.synchronize(device)
    before = backend.memory_stats(device).allocated
    backend.reset_peak_memory(device)
    grads = [torch.randn_like(t) for t in outs]
    torch.autograd.backward(outs, grads)
    backend.synchronize(device)
    return max(0, backend.memory_stats(device).peak_allocated - before), grads


def recomputed_backward_extra(backend: Backend, device: int, blk: nn.Module, forward: Callable[[], Any]) -> int:
    """:func:`backward_extra` of ``forward()`` run as the executor wraps a recomputed block:
    measured, since its backward frees the rebuilt activations as it goes and shares the input
    with what the wrapper kept (act_bytes plus the keeping backward's extra had over-counted a
    recomputed block by its input, and a selectively recomputed one by up to half)."""
    for p in blk.parameters():
        p.grad = None
    outs = [t for t in torch.utils._pytree.tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
    extra, _ = backward_extra(backend, device, outs)
    for p in blk.parameters():
        p.grad = None
    return extra
