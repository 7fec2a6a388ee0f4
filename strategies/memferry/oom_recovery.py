"""A step that runs out of device memory runs again under the budget or a new plan, not lost.

The rehearsal (``rehearsal.py``) fits a plan before training, but a step can still run out of
memory later: on the H200, with expandable segments turned off by the user, a plan whose
rehearsal reserved 17.2 GB of the 17.54 it was held to ran out in its second step with 849 MB
reserved but unallocated (the caching allocator's fragmentation grew over steps; session 23).
:func:`replan_after_oom` turns such an error into a re-plan: the engine keeps the weights and
optimizer state the step started from (no update of the step has begun), gives its buffers
back (and the allocator its cache: ``Backend.release_cache``), and is built again for the plan the scheduler makes from the same profile with the memory
margin raised by :data:`~.rehearsal.MARGIN_STEP`, its allocator capped at the budget (the old
prediction was just shown short, and the new plan is not rehearsed); the caller then runs the
step again from its first micro-batch. The new plan holds the longest micro-batch the engine
has met (``batch_growth.py``): a longer one than the sample, met late in a step, is what may
have run out. A rehearsed engine's allocator is held at its plan's predicted peak, under the
budget (``rehearsal.hold_to_plan``); where the plan was made for the longest micro-batch met,
the first such error builds the same plan again with the cap lifted to the budget instead
(session 54's LoRA row ran out with 0.28 GB reserved but unallocated over a 7.46 GB hold under
8 GB: fragmentation the budget's rest has room for), and only a step that runs out after that
is planned again with the larger margin. :class:`ReplanningSteps` does it all around a step, at
most :data:`ATTEMPTS` times a run: the training loop's MemFerry engine
(``strategies/training/engines.py``) and the benchmark's MemFerry rows
(``bench/systems/memferry.py``) step through it.

It is exact only before the step's last backward: from then on host updates run as gradients
land, and the step cannot be run again. Nor can a plan given rather than scheduled be made again,
nor one rank of a data-parallel run re-plan alone, nor a host without room for a copy of the
optimizer state keep it through the rebuild. Those raise :class:`StepOutOfMemoryError`, which
says what would work.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from xpu.errors import XpuError
from xpu.hostmem import mem_available
from xpu.units import format_bytes, parse_bytes

from .batch_growth import longest_shape, plan_holds_longest, scaled_profile
from .planning import replan
from .rehearsal import MARGIN_STEP, _rebuild
from .scheduler import NoPlanFitsError

if TYPE_CHECKING:
    from .engine import MemFerry

__all__ = ["replan_after_oom", "ReplanningSteps", "rebuild_keeping_state", "rebuild_refusal", "cap_at_budget",
           "budget_bytes", "StepOutOfMemoryError", "ATTEMPTS"]

_log = logging.getLogger("xpu.memferry")

#: Re-plans after out-of-memory errors that one training run may make.
ATTEMPTS = 3

_T = TypeVar("_T")


class StepOutOfMemoryError(XpuError, torch.OutOfMemoryError):
    """A step ran out of device memory and could not be planned again (the message says why and
    what would work). Also a ``torch.OutOfMemoryError``: ``xpu train`` reports it as it reports
    any (its first line, exit code 3)."""


def _state_bytes(engine: "MemFerry") -> int:
    """Host bytes a rebuild keeping the state takes beyond the shadow it replaces, at most. The
    state (weights, and the trainable parameters' master and Adam moments: 16 B per parameter)
    is taken out unit by unit as the shadow frees the same bytes of a host-homed unit
    (``ShadowModel.release``) and put back unit by unit (``ShadowModel(kept=...)``), so: one
    unit's state at a time, the device-homed units' whole state (their buffers free device
    memory, not host), and the model cast to its compute dtype again before the new shadow
    takes it."""
    def state(s) -> int:
        return 4 * sum(p.numel() for _, p in s.unit.params) + 12 * sum(p.numel() for _, p in s.unit.trainable)

    shadows = engine.shadow.shadows
    dtype = engine._setup["compute_dtype"]
    cast = dtype.itemsize * sum(p.numel() for s in shadows for _, p in s.unit.params) if dtype is not None else 0
    one = max((state(s) for s in shadows if s.home == "host"), default=0)
    return one + sum(state(s) for s in shadows if s.home == "device") + cast


def rebuild_refusal(engine: "MemFerry", same_plan: bool = False) -> str | None:
    """Why ``engine`` cannot be built again between steps for another plan (``same_plan``: for
    its own plan), or None."""
    if engine.dp is not None:
        return "under data parallelism the ranks plan together only at setup"
    if engine.plan.profile is None and not same_plan:
        return "the plan was given, not scheduled, so it cannot be made again"
    available, need = mem_available(), _state_bytes(engine)
    if available is not None and available < need:
        return (f"keeping the optimizer state through a rebuild takes {format_bytes(need)} of host memory and "
                f"{format_bytes(available)} is available")
    return None


def _refusal(engine: "MemFerry", same_plan: bool) -> str | None:
    """Why the engine's interrupted step cannot be run again under a new plan (``same_plan``: its
    own), or None."""
    if engine.micro.backwards >= engine.micro.steps:
        return ("it ran out during the step's last backward or its update, after host updates had begun, so "
                "the step cannot be run again exactly; resume from the last checkpoint with a memory_margin "
                f"above {engine._setup['memory_margin']:.2f}")
    why = rebuild_refusal(engine, same_plan)
    if why is None:
        return None
    if engine.plan.profile is None:
        return f"{why}; use plan='auto', or a plan with +recompute or fewer resident blocks"
    return f"{why}; restart from the last checkpoint with a larger memory_margin"


def _held_below_budget(engine: "MemFerry") -> int | None:
    """The allocator's cap where the rehearsal holds it under the engine's budget
    (``rehearsal.hold_to_plan``) and the plan was made for the longest micro-batch met, else None
    (a longer one is planned for: ``batch_growth.py``)."""
    cap = engine.backend.memory_cap(engine.device)
    if engine._setup["device_budget"] is None or cap is None or not plan_holds_longest(engine):
        return None
    return cap if cap < budget_bytes(engine) else None


def replan_after_oom(engine: "MemFerry", error: BaseException | str) -> str:
    """Build ``engine`` again after ``error``, an out-of-memory error raised inside one of its
    steps, keeping the weights and optimizer state the step started from; the caller then runs
    the step again from its first micro-batch. Call it after leaving the ``except`` block, so
    that the failed step's graph is gone.

    Where the allocator was held under the budget at the plan's prediction and the plan holds
    the longest micro-batch met, the same plan is built again with the cap lifted to the budget
    (it stays as fast); otherwise the plan is made again with a larger memory margin (see the
    module docstring).

    Returns:
        What was done, one line (also logged, and added to ``engine.plan.notes``).

    Raises:
        StepOutOfMemoryError: the step cannot be run again (see the module docstring), or no plan
            fits with the larger margin.
    """
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    held = _held_below_budget(engine)
    why = _refusal(engine, same_plan=held is not None)
    if why:
        raise StepOutOfMemoryError(f"MemFerry ran out of device memory in a step ({said[:120]}); {why}")
    setup = engine._setup
    budget = budget_bytes(engine)
    if held is not None:
        rebuild_keeping_state(engine, engine.plan)
        return _tell(engine, f"out of memory in a step ({said[:120]}) with the allocator held at the plan's predicted "
                             f"peak, {format_bytes(held)}: the same plan built again, the allocator capped at the "
                             f"budget, {format_bytes(budget)}; the step runs again")
    margin = setup["memory_margin"] + MARGIN_STEP
    old = engine.plan
    shape = longest_shape(engine)  # a micro-batch longer than planned for may be what ran out (batch_growth.py)
    profile = scaled_profile(old.profile, *shape)
    try:
        plan = replan(old, budget, engine.backend, engine.device, margin, profile=profile)
    except NoPlanFitsError as exc:
        raise StepOutOfMemoryError(f"MemFerry ran out of device memory in a step ({said[:120]}) and no plan fits "
                                   f"with a {margin:.0%} memory margin: {exc}") from None
    rebuild_keeping_state(engine, plan)
    setup["memory_margin"], setup["shape"] = margin, shape
    setup.pop("shape_next", None)
    return _tell(engine, f"out of memory in a step ({said[:120]}): planned again with a {margin:.0%} memory margin, "
                         f"predicted peak {format_bytes(plan.predicted_peak_bytes or 0)} (was "
                         f"{format_bytes(old.predicted_peak_bytes or 0)}), the allocator capped at the budget, "
                         f"{format_bytes(budget)}; the step runs again")


def _tell(engine: "MemFerry", note: str) -> str:
    """``note``, added to the engine's plan notes and logged."""
    engine.plan.notes.append(note)
    _log.warning("MemFerry: %s", note)
    return note


class ReplanningSteps:
    """Runs ``engine``'s steps so that one that runs out of device memory is planned again
    (:func:`replan_after_oom`) and run again from its first micro-batch, at most :data:`ATTEMPTS`
    times in all; the training loop's engine and the benchmark's MemFerry rows step through it.

    Attributes:
        replans: steps run again so far.
        notes: what each re-plan did, in order (:func:`replan_after_oom`'s lines; a new plan's
            own notes start afresh).
    """

    def __init__(self, engine: "MemFerry") -> None:
        self.engine = engine
        self.replans = 0
        self.notes: list[str] = []

    def run(self, step: Callable[[], _T]) -> _T:
        """``step()`` (one whole step of ``engine``: every micro-batch's forward and backward and
        the update), again after each out-of-memory error it can re-plan; any other error, one it
        cannot re-plan (:class:`StepOutOfMemoryError`) and the one past the attempts propagate."""
        while True:
            try:
                return step()
            except torch.OutOfMemoryError as exc:
                if isinstance(exc, StepOutOfMemoryError) or self.replans >= ATTEMPTS:
                    raise
                failed = str(exc)
            # Out of the except block: the failed step's graph (held by the traceback) is gone.
            self.notes.append(replan_after_oom(self.engine, failed))
            self.replans += 1


def budget_bytes(engine: "MemFerry") -> int:
    """The engine's device budget in bytes (the device's memory where none was given)."""
    given = engine._setup["device_budget"]
    return parse_bytes(given) if given is not None else engine.backend.mem_info(engine.device)[1]


def rebuild_keeping_state(engine: "MemFerry", plan: Any) -> None:
    """Build ``engine`` again for ``plan`` between steps, keeping its weights, optimizer state,
    learning rate and LR scheduler; its allocator capped at the budget (no rehearsal: not held to
    the new prediction). The caller has checked it can (:func:`rebuild_refusal`)."""
    backend, device = engine.backend, engine.device
    engine.optimizer.wait_all()  # the previous step's updates are part of the state kept
    handle, lr = engine._handle, engine._lr
    # The budget, not the old plan's hold (``rehearsal.hold_to_plan``), bounds the rebuild too: a
    # hold at the old prediction had refused the new plan's buffers while the old ones were alive.
    cap_at_budget(engine)
    # The state taken out and put back unit by unit; the optimizers, built after, take their step counts from it.
    _rebuild(engine, plan, keep_optimizer=True)
    backend.release_cache(device)  # the old plan's cached fragments: the new plan starts from what is in use
    engine._handle = handle  # an LR scheduler's optimizer stays this engine's
    engine.set_lr(lr)


def cap_at_budget(engine: "MemFerry") -> None:
    """Cap the engine's device at its budget (lifting a cap held to a plan's prediction,
    ``rehearsal.hold_to_plan``), or not at all where it has no budget."""
    engine.backend.set_memory_cap(engine.device, budget_bytes(engine) if engine._setup["device_budget"] is not None else None)
