"""Gradient accumulation on the device for host-updated units (``UnitPlan.accumulate="device"``).

Under ``accumulation_steps`` N > 1 a host-updated unit's gradient normally goes home after every
micro-batch (2 bytes per parameter over the device->host link in bf16) and the host optimizer
adds it into the unit's fp32 ``grad_acc`` (about 10 bytes per parameter of host memory traffic).
A unit planned ``accumulate="device"`` instead sums its micro-batches' gradients into an fp32
device buffer (4 bytes per parameter: storage given at the step's first micro-batch, given back
once the sum has been copied out, as ``DeviceOptimizer`` does for device-homed units). On the
last micro-batch the executor copies the fp32 sum into ``grad_acc`` (4 bytes per parameter, once
per step; under data parallelism averaged over the ranks first, once: averaging is linear, and
only this rank's shard goes home) and submits it as complete: the host optimizer updates from it
as from a host sum. The adds are fp32 adds of the same exactly upcast values in the same
micro-batch order as the host's, so the update is bit-equal to ``accumulate="host"``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .config import Plan
from .shadow import UnitShadow

__all__ = ["DeviceSums", "add_grads", "check_accumulate"]


def add_grads(s: UnitShadow, flat: torch.Tensor, first: bool) -> None:
    """Upcast (``first``) or add the unit's trainable gradients into the fp32 ``flat`` (laid out as
    its trainable prefix), and drop them."""
    views, grads = s.train_slices(flat), [p.grad for _, p in s.unit.trainable]
    # One call per unit, not one per tensor (the training thread issues these every micro-batch).
    if first:
        torch._foreach_copy_(views, grads)
    else:
        torch._foreach_add_(views, grads)  # fp32 += upcast value: what the host's accumulate computes
    for _, p in s.unit.trainable:
        p.grad = None


class DeviceSums:
    """The fp32 device sums of the units planned ``accumulate="device"``.

    Args:
        backend: gives the buffers memory only from a step's first micro-batch to the copy out.
        device: device index.
        shadows: the units summing on the device (host-homed, with something to train).
    """

    def __init__(self, backend: Any, device: int, shadows: list[UnitShadow]) -> None:
        self.b = backend
        self._flat: dict[int, torch.Tensor] = {}
        for s in shadows:
            flat = backend.empty(s.unit.train_numel, torch.float32, device)
            backend.free_storage(flat)
            self._flat[s.unit.index] = flat
        self._open: set[int] = set()  # units whose buffer holds this step's partial sum

    def __contains__(self, s: UnitShadow) -> bool:
        return s.unit.index in self._flat

    def add(self, s: UnitShadow) -> None:
        """Sum the unit's gradients of this micro-batch into its buffer (on the current stream)."""
        index = s.unit.index
        first = index not in self._open
        if first:
            self.b.realloc_storage(self._flat[index])
        add_grads(s, self._flat[index], first)
        self._open.add(index)

    def open_units(self) -> list[int]:
        """Indices of the units holding a partial sum (a step ended early sends them), in order."""
        return sorted(self._open)

    def total(self, s: UnitShadow, reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The unit's complete sum: averaged with ``reduce`` (data parallelism) if given, and cut to
        this rank's trainable shard (what its host optimizer updates)."""
        flat = self._flat[s.unit.index]
        if reduce is not None:
            reduce(flat)
        return flat[s.train_shard] if s.shard is not None else flat

    def release(self, s: UnitShadow, stream: Any) -> None:
        """Give the buffer's memory back once ``stream`` (the copy out) is past it."""
        flat = self._flat[s.unit.index]
        self.b.keep_alive(flat, stream)
        self.b.free_storage(flat)
        self._open.discard(s.unit.index)

    def discard(self, stream: Any) -> None:
        """Give back every partial sum (the engine closes mid-step)."""
        for index in self.open_units():
            self.b.keep_alive(self._flat[index], stream)
            self.b.free_storage(self._flat[index])
        self._open.clear()


def check_accumulate(plan: Plan, accumulation_steps: int) -> None:
    """Raise ValueError if ``plan`` sums micro-batches on the device without accumulation."""
    for i, u in enumerate(plan.units):
        if u.accumulate == "device" and accumulation_steps < 2:
            raise ValueError(f"block {i}: accumulate='device' sums a step's micro-batches on the device, but "
                             f"accumulation_steps is {accumulation_steps}: give MemFerry(accumulation_steps=N) with "
                             f"N > 1, or leave accumulate='host'")
