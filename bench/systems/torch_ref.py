"""The ``torch`` system: plain PyTorch with everything on the device (docs/design.md §3 anchor 0.132 s).

Options:
    precision: ``"pure"`` (default; the anchor's setup) keeps weights, gradients and AdamW
        states in the scenario dtype (bf16 on an accelerator); ``"amp"`` keeps fp32 weights
        and states and runs forward/backward under autocast to the scenario dtype.
    recompute: recompute each block in backward (docs/design.md §3: 0.158 s, 11.3 GB).
    fused: use the fused AdamW kernel.
    optimizer: False times forward and backward alone (no optimizer, gradients dropped each
        step): the device's compute time measured alone, a floor for offloading systems.
"""
from __future__ import annotations

import contextlib

import torch

from .base import BenchSystem, SystemContext, forward_backward, module_step, set_recompute

__all__ = ["TorchSystem", "make"]


class TorchSystem(BenchSystem):
    """Model and AdamW states on the device; per call, ``accumulation_steps`` forward/backwards
    and one optimizer step (biases and norm weights without weight decay)."""

    def __init__(self, ctx: SystemContext) -> None:
        precision = ctx.options["precision"]
        if precision not in ("pure", "amp"):
            raise ValueError(f"torch system: precision must be 'pure' or 'amp', got {precision!r}")
        amp = precision == "amp" and ctx.dtype != torch.float32
        # Built straight on the device in its final dtype: no host copy, no fp32 transient.
        self.model = ctx.build_model(device=ctx.device, dtype=torch.float32 if amp else ctx.dtype)
        recompute = set_recompute(self.model, ctx.options["recompute"])
        self.model.train()
        self.optimizer = None
        if ctx.options["optimizer"]:
            self.optimizer = torch.optim.AdamW(ctx.adamw_params(self.model), fused=bool(ctx.options["fused"]),
                                               **ctx.adamw_kwargs())
        self._accumulation = ctx.accumulation_steps
        self._autocast = (lambda: torch.autocast(ctx.backend.device_type, dtype=ctx.dtype)) if amp else contextlib.nullcontext
        self.notes = f"precision={precision}" + (f", {recompute}" if recompute else "") + (
            "" if self.optimizer else ", forward and backward only (no optimizer)")

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.optimizer is None:
            return forward_backward(self.model, inputs, targets, self._autocast, self._accumulation)
        return module_step(self.model, self.optimizer, inputs, targets, self._autocast, self._accumulation)


def make(ctx: SystemContext) -> TorchSystem:
    """Factory registered as ``torch``."""
    return TorchSystem(ctx)
