"""peft LoRA linears with their adapter's product added inside the base output's GEMM.

Why: peft's ``lora.Linear`` adds its adapter as ``result + lora_B(lora_A(x)) * scaling``: three
whole passes over the layer's output (``lora_B``'s output, the scaled copy, the sum) besides
the GEMMs, and more in backward. On a Qwen2-1.5B-shaped model under MemFerry (seven adapted
linears a layer, 4 x 2048 tokens, bf16, H100, 2026-12-07,
``bench/results/2026-12-07-h100-session52/call2``) a LoRA decoder layer's forward took 1.41x full
fine-tuning's (the same GEMMs), and its backward, which makes no base weight gradient, as long.
Here the adapter's product is added to the base output by one GEMM (``scaling * (x A^T) B^T +
y``, cuBLAS's ``beta = 1``), and its backward makes ``dY B`` once for both ``dA`` and ``dX``.

:func:`fuse_lora` swaps the forward of every peft ``lora.Linear`` in a model for one that takes
this path where it is exact for the adapter as configured (one active vanilla adapter, not
merged, no call-time options, matching dtypes, no autocast; dropout applied as peft applies it)
and calls peft's own forward otherwise, so every peft feature keeps working; weights, state
dicts and exports are untouched. Numerics: the sum is rounded once (peft rounds ``lora_B``'s
output, its scaled copy and the sum), so results differ from peft's by bf16 rounding, not more.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["fuse_lora", "lora_delta"]


class _LoraDelta(torch.autograd.Function):
    """``y + scale * (x @ A^T) @ B^T`` in one GEMM; gradients for ``y`` (passed through), ``x``, ``A``, ``B``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 @ a.t()  # (tokens, r): small
        # A new tensor, not ``y`` updated in place: the same traffic (read y, write the sum), and
        # a base output that selective checkpointing cached stays as it was cached.
        out = torch.addmm(y.reshape(-1, y.shape[-1]), xa, b.t(), alpha=scale).view(y.shape)
        ctx.save_for_backward(x, xa, a, b)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, xa, a, b = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[1:4]
        g2 = g.reshape(-1, g.shape[-1])
        dx = da = db = None
        if need_x or need_a:
            gb = (g2 @ b).mul_(ctx.scale)  # (tokens, r): dY B, scaled once for both uses
            if need_x:
                dx = (gb @ a).view_as(x)
            if need_a:
                da = gb.t() @ x.reshape(-1, x.shape[-1])
        if need_b:
            db = g2.t() @ (xa * ctx.scale)
        return g, dx, da, db, None


def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """A linear layer's output plus its LoRA adapter's product, ``y + scale * (x A^T) B^T``, made by one GEMM.

    Args:
        y: the base layer's output, ``(..., out_features)``; left as it is.
        x: the layer's input, ``(..., in_features)``, same leading shape and dtype as ``y``.
        a: ``lora_A``'s weight, ``(r, in_features)``.
        b: ``lora_B``'s weight, ``(out_features, r)``.
        scale: the adapter's scaling (``alpha / r``, or peft's rsLoRA value).
    """
    return _LoraDelta.apply(y, x, a, b, scale)


def _fused_forward(layer: nn.Module, peft_forward: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``lora.Linear.forward``, on the fused path where that is exact for ``layer``'s state."""
    active = layer.active_adapters
    name = active[0] if len(active) == 1 else None
    if (args or kwargs or name is None or layer.disable_adapters or layer.merged or name not in layer.lora_A
            or name in getattr(layer, "lora_variant", {})):
        return peft_forward(x, *args, **kwargs)
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if (not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)) or lora_a.bias is not None
            or lora_b.bias is not None or not x.dtype == lora_a.weight.dtype == lora_b.weight.dtype
            or torch.is_autocast_enabled(x.device.type)):
        return peft_forward(x, *args, **kwargs)  # peft casts between dtypes; one rounding path there
    y = layer.base_layer(x)
    xd = layer.lora_dropout[name](x)  # peft's one dropout call per adapter (Identity without dropout)
    if y.dtype != x.dtype:  # a base layer computing in another dtype: peft's order of casts
        return (y + lora_b(lora_a(xd)) * layer.scaling[name]).to(y.dtype)
    return lora_delta(y, xd, lora_a.weight, lora_b.weight, float(layer.scaling[name]))


def fuse_lora(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` in ``model`` the fused forward (see the module docstring);
    return how many. Idempotent; a model without peft layers is left as it is (0)."""
    # A model holding peft layers has imported peft; importing it here for a model that has none
    # would cost every plain engine seconds (peft imports much of transformers).
    if "peft" not in sys.modules:
        return 0
    from peft.tuners.lora import layer as lora_layer
    count = 0
    for m in model.modules():
        if type(m) is not lora_layer.Linear:  # subclasses (quantised bases) keep peft's forward
            continue
        if not getattr(m, "_xpu_fused_lora", False):
            m.forward = functools.partial(_fused_forward, m, m.forward)
            m._xpu_fused_lora = True
        count += 1
    return count
