"""MemFerry as a benchmarked system (``xpu bench`` name ``memferry``).

Options:
    plan: a :meth:`~strategies.memferry.config.Plan.from_spec` name, e.g.
        ``prefetch+recompute`` or ``device15+recompute``.
    max_grad_norm: global-norm clipping (None: off).
"""
from __future__ import annotations

import torch

from bench.systems.base import BenchSystem, SystemContext, phase

from .config import AdamW, Plan
from .engine import MemFerry

__all__ = ["MemFerrySystem", "make"]


class MemFerrySystem(BenchSystem):
    """The model built on the host, handed to a :class:`MemFerry` engine."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext) -> None:
        model = ctx.build_model(dtype=ctx.dtype)
        plan = Plan.from_spec(ctx.options["plan"], len(model.blocks))
        cfg = AdamW(**ctx.adamw_kwargs(), max_grad_norm=ctx.options["max_grad_norm"])
        self.engine = MemFerry(model, optim=cfg, plan=plan, backend=ctx.backend, device=ctx.device_index)
        self.notes = f"plan={ctx.options['plan']}"

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with phase("forward"):
            loss = self.engine(inputs, targets)
        with phase("backward"):
            self.engine.backward(loss)
        with phase("optimizer"):
            self.engine.step()
        return loss.detach()

    def close(self) -> None:
        self.engine.close()


def make(ctx: SystemContext) -> MemFerrySystem:
    """Factory registered as ``memferry``."""
    return MemFerrySystem(ctx)
