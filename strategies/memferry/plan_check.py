"""The rules a MemFerry plan must meet to run on a model and backend, checked before anything
touches the model (the engine) and again where an executor is built on its own."""
from __future__ import annotations

from xpu import Backend

from .config import Plan
from .device_accumulation import check_accumulate

__all__ = ["check_plan"]


def check_plan(plan: Plan, n_blocks: int, backend: Backend, accumulation_steps: int = 1) -> None:
    """Raise ValueError, saying what to change, if ``plan`` cannot run on ``n_blocks`` here with
    ``accumulation_steps`` micro-batches per step."""
    if len(plan.units) != n_blocks:
        raise ValueError(f"the plan covers {len(plan.units)} blocks, the model has {n_blocks}")
    if plan.prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be at least 1, got {plan.prefetch_depth}")
    for i, u in enumerate(plan.units):
        if not u.recompute and u.forward != u.backward:
            raise ValueError(
                f"block {i}: without recompute, backward reads the weights forward saved, so backward must use "
                f"forward's mode ({u.forward!r}); set recompute=True to choose a different backward mode"
            )
        if "dha" in (u.forward, u.backward) and not backend.caps.dha:
            raise ValueError(f"block {i} plans DHA, but backend '{backend.name}' has no Direct Host Access (caps.dha)")
    check_accumulate(plan, accumulation_steps)
