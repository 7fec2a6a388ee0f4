"""Clipping's global gradient norm, summed on the device so that no step waits for it.

``torch.nn.utils.clip_grad_norm_`` scales every gradient by ``min(1, max_norm / (norm + 1e-6))``,
where ``norm`` is the 2-norm of all of them together. MemFerry's gradients are spread out: a
device-homed unit's stay on the device; a host-homed unit's go home as backward makes them.

Where a unit's whole gradient of the step is on the device before it goes home (one micro-batch,
or a sum made on the device; not a DHA unit's, whose linears write gradients home as they run,
nor a data-parallel rank's shard), its squares are summed there, on the compute stream, into one
fp64 total (:class:`DeviceNorms`, by ``adamw.squared_norm_sum``). When that
holds for every host-homed unit (``GlobalNormClip.on_device``), the coefficient is computed on
the device right after the last gradient (:func:`device_coefficient`, in fp64 as
``clip_grad_norm_`` scales). The device-homed units' updates read it from device memory, and
it comes home behind the last gradient copy (:class:`PendingClip`), where the host optimizer's
worker reads it. So the training thread never waits for a norm, and the next forward is queued
at once.

Otherwise the host sums the squares of the other units' gradients (one more read of each), and
the training thread waits for them in ``step()`` (:meth:`GlobalNormClip.coefficient`).

Each host-homed unit whose squares the device sums also brings home the running sum as it
stood after its own (``GlobalNormClip.partials``). Sums of squares only grow, so once that with
the host's own part so far makes the coefficient fall below 1 (:func:`clips`), the step will
clip: the host optimizer stops starting speculative updates, which would only be re-applied.

Either way, the global norm of each step and how many steps clipped are kept
(:class:`GlobalNormClip`, the last :data:`HISTORY` steps' norms and coefficients too), read when
asked.
"""
from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import torch

from .adamw import squared_norm_sum
from .config import Plan, UnitPlan

__all__ = ["DeviceNorms", "GlobalNormClip", "PendingClip", "clips", "device_coefficient", "norm_on_device"]

#: torch.nn.utils.clip_grad_norm_'s guard against division by zero.
EPS = 1e-6
#: Steps whose ``(norm, coefficient)`` :attr:`GlobalNormClip.history` keeps.
HISTORY = 4096


def clips(sq: float, max_norm: float) -> bool:
    """Whether a squared norm of ``sq`` makes the coefficient ``min(1, max_norm / (norm + 1e-6))``
    fall below 1; true of a partial sum means true of the whole (every operation is monotone)."""
    return max_norm / (math.sqrt(sq) + EPS) < 1.0


def norm_on_device(unit: UnitPlan, accumulation_steps: int, data_parallel: bool) -> bool:
    """Whether a host-homed unit run as ``unit`` has its whole gradient of the step on the device
    before it goes home (see the module): no DHA forward (whose linears write weight gradients
    home), no data parallelism (a rank brings home its shard), and one micro-batch or a sum made
    on the device."""
    return (not data_parallel and unit.forward != "dha"
            and (accumulation_steps == 1 or unit.accumulate == "device"))


class DeviceNorms:
    """The step's sum of squared gradient entries on the device, fp64, in the order added."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, grads: Sequence[torch.Tensor]) -> None:
        """Add the squares of ``grads`` (queued on the current stream; no sync)."""
        if not grads:
            return
        part = squared_norm_sum(grads)
        self.total = part if self.total is None else self.total + part

    def take(self) -> torch.Tensor | None:
        """The step's total (None: nothing added), and start the next step at zero."""
        total, self.total = self.total, None
        return total


def device_coefficient(sq: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, coefficient)`` from the squared norm ``sq`` (fp64, 0-dim), as device tensors:
    ``norm = sqrt(sq)``, ``coef = min(1, max_norm / (norm + 1e-6))`` in fp64, as
    ``torch.nn.utils.clip_grad_norm_`` scales (a true division: ``max_norm * (1 / x)`` rounds twice)."""
    norm = sq.sqrt()
    coef = torch.full_like(norm, max_norm).div_(norm + EPS).clamp_(max=1.0)  # a true division, not reciprocal * max
    return norm, coef


class PendingClip:
    """A step's norm and coefficient on their way home (see the module).

    Args:
        backend: the xpu backend.
        norm, coef: 0-dim fp64 device tensors (:func:`device_coefficient`).
        after: the stream the last gradient copies were queued on; the two values follow them.
        compute: the stream that computed them.
        buffer: a pinned fp64 host buffer of two elements to land in.
        give_back: called with ``buffer`` once the values are read.
    """

    def __init__(self, backend: Any, norm: torch.Tensor, coef: torch.Tensor, after: Any, compute: Any,
                 buffer: torch.Tensor, give_back: Callable[[torch.Tensor], None]) -> None:
        self.device_coef = coef
        self._buffer, self._give_back = buffer, give_back
        self._values: tuple[float, float] | None = None
        self._lock = threading.Lock()
        pair = torch.stack([norm, coef])  # on ``compute``, before the event the copy waits for
        made = backend.event()
        made.record(compute)
        after.wait_event(made)
        with backend.use_stream(after):
            backend.copy(buffer, pair, after)
            backend.keep_alive(pair, after)
            self._landed = backend.event()
            self._landed.record(after)

    def ready(self) -> bool:
        """Whether the values have landed (no blocking)."""
        return self._values is not None or self._landed.query()

    def values(self) -> tuple[float, float]:
        """``(norm, coefficient)`` as floats; blocks until they have landed (any thread)."""
        with self._lock:
            if self._values is None:
                self._landed.synchronize()
                self._values = (float(self._buffer[0]), float(self._buffer[1]))
                self._give_back(self._buffer)
            return self._values

    def coef(self) -> float:
        """The coefficient (blocks until it has landed)."""
        return self.values()[1]


class GlobalNormClip:
    """One engine's clipping: the device sum, the coefficient of each step, and its record.

    Args:
        backend: the xpu backend.
        max_norm: ``AdamW.max_grad_norm``.
        device_normed: indices of the host-homed units whose squares the device sums
            (:func:`norm_on_device`); the host sums the others'.
        on_device: every host-homed unit's are (the coefficient is then made on the device).
        units: how many units the engine has (the length of :attr:`partials`).
    """

    def __init__(self, backend: Any, max_norm: float, device_normed: frozenset[int], on_device: bool,
                 units: int) -> None:
        self.b, self.max_norm, self.device_normed, self.on_device = backend, max_norm, device_normed, on_device
        #: per unit index in ``device_normed``: the running squared norm its step gradient brought
        #: home (pinned; written behind the gradient's copy, read once it has landed)
        self.partials = self.b.alloc_pinned(8 * units).view(torch.float64)
        self.norms = DeviceNorms()
        self._free: list[torch.Tensor] = []  # pinned landing places of two fp64 values
        self._free_lock = threading.Lock()
        self._last: PendingClip | tuple[float, float] | None = None  # the last step's (norm, coef)
        self._uncounted: PendingClip | None = None
        self._clipped = 0
        self._history: deque[tuple[float, float]] = deque(maxlen=HISTORY)

    @classmethod
    def for_plan(cls, backend: Any, max_norm: float, units: Sequence[Any], plan: Plan, host_homed: set[int],
                 accumulation_steps: int, data_parallel: bool) -> "GlobalNormClip":
        """The clipping of an engine running ``units`` (``split_units``: blocks, then the rest unit)
        as ``plan``; ``host_homed``: indices of the units the host updates."""
        runs = dict(zip((u.index for u in units if u.is_block), plan.units))
        runs[units[-1].index] = UnitPlan("resident", "resident", optimizer=plan.rest_optimizer)
        homed = [u.index for u in units if u.index in host_homed and u.trainable]
        normed = frozenset(i for i in homed if norm_on_device(runs[i], accumulation_steps, data_parallel))
        return cls(backend, max_norm, normed, len(normed) == len(homed), len(units))

    def add(self, index: int, grads: Sequence[torch.Tensor]) -> None:
        """Unit ``index``'s step gradient ``grads`` is about to go home: sum their squares on the
        device if the unit is in :attr:`device_normed` (on the current stream)."""
        if index in self.device_normed:
            self.norms.add(grads)

    def send_running_sum(self, index: int, stream: Any) -> None:
        """Queue unit ``index``'s running sum (with its own squares) home on ``stream``, behind
        its gradient: into :attr:`partials`, if the device sums its squares."""
        partial = self.norms.total if index in self.device_normed else None
        if partial is not None:
            self.b.copy(self.partials[index], partial, stream)
            self.b.keep_alive(partial, stream)

    def coefficient(self, host_sq: Callable[[], float], after: Any) -> tuple[Any, Any]:
        """This step's coefficient as ``(for the device optimizer, for the host optimizer)``;
        ``after``: the device→host stream the gradient copies went on (the coefficient follows them).

        On the device: a device tensor and a :class:`PendingClip` (nothing waits). Otherwise the
        same float twice, after ``host_sq()`` (the host's part of the squared norm) and the device
        part (both block)."""
        self._count()  # the previous step's, long landed: its buffer is free again
        device_sq = self.norms.take()
        if self.on_device:
            if device_sq is None:
                device_sq = torch.zeros((), dtype=torch.float64, device=self.b.device(self.b.current_device()))
            norm, coef = device_coefficient(device_sq, self.max_norm)
            pending = PendingClip(self.b, norm, coef, after, self.b.current_stream(), self._buffer(), self._recycle)
            self._last = self._uncounted = pending
            return coef, pending
        sq = host_sq() + (float(device_sq) if device_sq is not None else 0.0)
        norm = math.sqrt(sq)
        coef = min(1.0, self.max_norm / (norm + EPS))  # as torch.nn.utils.clip_grad_norm_
        self._last = (norm, coef)
        self._clipped += coef != 1.0
        self._history.append(self._last)
        return coef, coef

    @property
    def last_norm(self) -> float | None:
        """The last step's global norm before clipping (None: no step yet); may wait for it."""
        if isinstance(self._last, PendingClip):
            return self._last.values()[0]
        return None if self._last is None else self._last[0]

    @property
    def clipped_steps(self) -> int:
        """Steps whose coefficient was below 1 so far (waits for the last step's)."""
        self._count()
        return self._clipped

    @property
    def history(self) -> list[tuple[float, float]]:
        """``(norm, coefficient)`` of each step so far, oldest first (the last :data:`HISTORY`;
        waits for the last step's)."""
        self._count()
        return list(self._history)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Steps inside never clip: the coefficient is 1 whatever the norm (:attr:`max_norm` is
        infinite meanwhile; the host optimizer's test for a step sure to clip reads it too). A
        rehearsal runs the same sample several times, so a first norm over ``max_norm`` clipped
        every rehearsal step, and each was priced as a plain step: a 24-layer plan rehearsed at
        280 ms where its plain steps ran at 175, and its calibration chose a slower plan (H100,
        2026-12-05). Only between steps: the worker reads :attr:`max_norm` while a step's
        gradients land."""
        max_norm, self.max_norm = self.max_norm, math.inf
        try:
            yield
        finally:
            self.max_norm = max_norm

    def reset(self) -> None:
        """Forget the steps so far (after the engine's rehearsal step)."""
        self._count()
        self._last, self._clipped = None, 0
        self._history.clear()

    def _count(self) -> None:
        if self._uncounted is not None:
            values = self._uncounted.values()
            self._clipped += values[1] != 1.0
            self._history.append(values)
            self._uncounted = None

    def _buffer(self) -> torch.Tensor:
        with self._free_lock:
            if not self._free:  # one pinned page holds many; two are in use at most
                self._free.extend(self.b.alloc_pinned(16 * 8).view(torch.float64).view(8, 2).unbind(0))
            return self._free.pop()

    def _recycle(self, buffer: torch.Tensor) -> None:
        with self._free_lock:
            self._free.append(buffer)
