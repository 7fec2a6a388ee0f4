"""MemFerry as a benchmarked system (``xpu bench`` name ``memferry``).

Options:
    plan: a :meth:`~strategies.memferry.config.Plan.from_spec` name, e.g.
        ``prefetch+recompute`` or ``device15+recompute``, or ``auto``: the scheduler profiles
        one batch and picks the plan under the scenario's device cap (its prediction goes in
        the row's notes, the explained plan in the worker log).
    max_grad_norm: global-norm clipping (None: off).
"""
from __future__ import annotations

import torch

from bench.systems.base import BenchSystem, SystemContext, engine_step

from .config import AdamW, Plan
from .engine import MemFerry

__all__ = ["MemFerrySystem", "make"]


class MemFerrySystem(BenchSystem):
    """The model built on the host, handed to a :class:`MemFerry` engine."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext) -> None:
        model = ctx.build_model(dtype=ctx.dtype)
        spec = ctx.options["plan"]
        cfg = AdamW(**ctx.adamw_kwargs(), max_grad_norm=ctx.options["max_grad_norm"])
        sample = None
        if spec == "auto":  # the scheduler profiles one batch of the scenario's shape under the device cap
            vocab = ctx.dims.get("vocab", 256)
            tokens = torch.randint(0, vocab, (ctx.batch, ctx.seq + 1), generator=torch.Generator().manual_seed(ctx.seed))
            sample = (tokens[:, :-1], tokens[:, 1:])
        plan = spec if spec == "auto" else Plan.from_spec(spec, len(model.blocks))
        cap = ctx.backend.memory_cap(ctx.device_index)
        self.engine = MemFerry(model, optim=cfg, plan=plan, backend=ctx.backend, device=ctx.device_index,
                               sample=sample, device_budget=cap)
        self.notes = f"plan={spec}"
        if spec == "auto":
            predicted = self.engine.plan.predicted_step_s
            self.notes += f" (predicted {predicted:.3f} s)" if predicted is not None else ""
            print(f"memferry plan chosen by the scheduler:\n{self.engine.plan.describe()}", flush=True)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return engine_step(self.engine, inputs, targets)

    def close(self) -> None:
        self.engine.close()


def make(ctx: SystemContext) -> MemFerrySystem:
    """Factory registered as ``memferry``."""
    return MemFerrySystem(ctx)
