"""Gradient accumulation bookkeeping: which micro-batch of the optimizer step the engine is in.

One optimizer step is ``accumulation_steps`` micro-batches, each a grad-enabled forward and
one ``backward()``; then ``step()``. The counter refuses the call orders that would silently
train wrong (a second forward whose graph would be dropped, a step with no gradient, more
backwards than declared) before anything changes.
"""
from __future__ import annotations

from typing import Any

__all__ = ["AccumulationError", "MicroBatches", "check_accumulation_steps", "paired_units", "sums_in_pairs"]


class AccumulationError(RuntimeError):
    """forward / backward / step called out of the order one optimizer step needs."""


def check_accumulation_steps(n: object) -> int:
    """``n`` as a positive int, or a one-line ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"accumulation_steps must be a positive int (micro-batches per optimizer step), got {n!r}")
    return n


class MicroBatches:
    """Counts forwards and backwards of the current optimizer step (see the module docstring)."""

    def __init__(self, steps: int) -> None:
        self.steps = check_accumulation_steps(steps)
        self.backwards = 0  # backward() calls since the last step()
        self.forward_open = False  # a grad-enabled forward waits for its backward

    def check_forward(self, grad_enabled: bool) -> None:
        """Before a forward: refuse a second grad-enabled forward before a backward, or any
        grad-enabled forward once the step's micro-batches are all in."""
        if not grad_enabled:
            return
        if self.forward_open:
            raise AccumulationError("forward ran twice without backward in between: call engine.backward(loss) on the "
                                    "first micro-batch's loss first (or run evaluation forwards under torch.no_grad())")
        if self.backwards >= self.steps:
            raise AccumulationError(f"all {self.steps} micro-batches of this step have run backward: call engine.step() "
                                    f"before the next forward (accumulation_steps={self.steps})")

    def forward_started(self, grad_enabled: bool) -> None:
        """A forward passed :meth:`check_forward` and runs now."""
        if grad_enabled:
            self.forward_open = True

    def check_backward(self) -> None:
        """Refuse a backward with no forward or past ``steps`` (changes nothing)."""
        if self.backwards >= self.steps:
            raise AccumulationError(f"backward() called {self.backwards + 1} times before step(), but accumulation_steps="
                                    f"{self.steps}: call engine.step() after every {self.steps} backward() calls, or "
                                    f"give MemFerry(accumulation_steps=...) the number of micro-batches per step")
        if not self.forward_open:
            raise AccumulationError("backward() with no forward before it: run loss = engine(inputs, ...) first")

    def begin_backward(self) -> bool:
        """Before a backward: :meth:`check_backward`, then count it; True if it ends the step's gradient."""
        self.check_backward()
        self.forward_open = False
        self.backwards += 1
        return self.backwards == self.steps

    def begin_step(self) -> bool:
        """Before a step: refuse one with nothing accumulated; True if it ends early (fewer backwards than declared)."""
        if self.backwards == 0:
            raise AccumulationError("step() with no gradient accumulated since the last step: call engine.backward(loss) "
                                    "first (one per micro-batch)")
        return self.backwards < self.steps

    def stepped(self) -> None:
        """The step's updates are issued: the next micro-batch starts a new step."""
        self.backwards = 0


def sums_in_pairs(unit: Any, data_parallel: bool) -> bool:
    """Whether a block run as ``unit`` (a ``UnitPlan``) has the host sum its micro-batches two at
    a time (``HostKernel.accumulate_pair``: 12 bytes of host memory per parameter for two,
    against 20 one by one): updated on the host and summing there (``accumulate="host"``),
    without DHA (a DHA block's linears write their gradients into one fixed zone), not under
    data parallelism (its shards land through another path)."""
    return (unit.optimizer == "host" and unit.accumulate == "host" and "dha" not in (unit.forward, unit.backward)
            and not data_parallel)


def paired_units(units: list[Any], plan: Any, accumulation_steps: int, data_parallel: bool) -> frozenset[int]:
    """Indices of the trainable units that sum in pairs (:func:`sums_in_pairs`; the ``rest`` unit
    when updated on the host); none with one micro-batch."""
    if accumulation_steps < 2 or data_parallel:
        return frozenset()
    paired = {u.index for u, up in zip(units, plan.units) if u.trainable and sums_in_pairs(up, data_parallel)}
    if plan.rest_optimizer == "host" and units[-1].trainable:
        paired.add(units[-1].index)
    return frozenset(paired)
