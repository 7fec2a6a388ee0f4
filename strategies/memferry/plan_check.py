"""The rules a MemFerry plan must meet to run on a model and backend, checked before anything
touches the model (the engine) and again where an executor is built on its own."""
from __future__ import annotations

from typing import Any

from xpu import Backend
from xpu.errors import XpuError
from xpu.units import format_bytes, parse_bytes

from .config import Plan
from .device_accumulation import check_accumulate

__all__ = ["check_plan", "check_budget", "PlanOverBudgetError"]


class PlanOverBudgetError(XpuError, ValueError):
    """A plan given to MemFerry (not scheduled) needs more than ``device_budget``: its floor
    (:func:`check_budget`) or its rehearsal step's peak; ``minimum`` is that need (bytes). An
    :class:`~xpu.errors.XpuError`: the ``xpu`` command prints its one line and exits 2."""

    def __init__(self, message: str, minimum: int | None = None) -> None:
        super().__init__(message)
        self.minimum = minimum


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


def check_budget(units: list, plan: Plan, device_homes: set[int], device_budget: Any) -> None:
    """Refuse a budget below what ``plan`` keeps on the device between steps, before any change.

    That floor counts resident weights (the ``rest`` unit and resident blocks) and the fp32
    masters and moments of device-homed units; activations and loads come on top of it.
    """
    budget = parse_bytes(device_budget)
    modes = {u.index: up for u, up in zip((u for u in units if u.is_block), plan.units)}
    floor = largest = 0
    for u in units:
        if not u.params:
            continue
        elem = u.params[0][1].element_size()
        if u.index in device_homes:
            # work (= master in fp32) of every parameter, moments (+ master) of the trainable ones
            floor += u.numel * elem + u.train_numel * (12 if elem != 4 else 8)
        elif not u.is_block or modes[u.index].forward == "resident":
            floor += u.numel * elem
        else:  # loaded whole to run (its device buffer is also made once when the engine is built)
            largest = max(largest, u.numel * elem)
    if floor + largest > budget:
        raise PlanOverBudgetError(
            f"device_budget {format_bytes(budget)} is below the {format_bytes(floor + largest)} this plan needs before "
            f"any activation: {format_bytes(floor)} kept on the device between steps (resident weights and "
            f"device-homed optimizer states) and {format_bytes(largest)} for its largest block loaded whole; give at "
            f"least that, a plan with fewer resident / device-homed blocks, or plan='auto' to let the scheduler fit "
            f"the budget", minimum=floor + largest)
