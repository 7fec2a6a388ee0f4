"""What the host optimizer's time goes to: seconds per phase, parameters updated, and the part
of the work done for micro-batches before a step's last.

The scheduler prices a host-homed unit's work in two parts (``host_budget.unit_terms``): the
sums of a step's earlier micro-batches, which run while later ones compute, and the work once
the last gradient has landed (the update), which the next forward may wait for. The rehearsal
(``rehearsal.py``) compares both with what the plan assumed (``host_calibration.py``), so this
clock keeps them apart: on the H200 the update ran 1.00-1.38x its price inside real steps of 8
micro-batches while the sums ran 0.73-1.13x theirs (bench/results/2026-12-04-h200-session21/).

Written by the host optimizer's worker thread; :meth:`HostClock.reading` may be called from any
thread (it reads a few floats, each assignment atomic under the GIL).
"""
from __future__ import annotations

from typing import NamedTuple

from .host_kernel import PHASES

__all__ = ["HostClock", "HostReading", "ClockReadings"]


class HostReading(NamedTuple):
    """The clock's totals at one moment (see :meth:`HostClock.reading`).

    Attributes:
        seconds: host work of finished updates, and every sum, so far (the ``PHASES``).
        numel: parameters those updates updated.
        earlier_s: among ``seconds``, the sums of micro-batches before a step's last.
    """

    seconds: float
    numel: int
    earlier_s: float


class HostClock:
    """The host optimizer's counters (see the module).

    Attributes:
        time_s: seconds per phase: ``wait`` for gradients to land, ``upcast`` (summing them, and
            a three-pass kernel's upcast), ``adamw``, ``call`` (the single-pass loops' calls
            beyond the loop: their Python side, and taking the GIL back), ``writeback``,
            ``consumer_wait`` (callers of ``HostOptimizer.wait``: the next forward blocked),
            ``zone_wait`` (callers of ``HostOptimizer.wait_consumed``: a backward blocked until
            the host had summed what the unit's landing zone held), ``backup`` (speculative
            clipping's copies and restores) and ``idle`` (the worker with nothing queued and no
            piece due, blocked for the next task: the bubbles of a host-bound step, e.g. between
            the last update the next forward needs and the first gradient of its backward).
        updated_numel: parameters updated so far (this rank's shards).
        earlier_s: seconds of work for micro-batches before a step's last: summing them (within
            ``upcast``) and split updates' second passes (within ``adamw``: ``split_update.py``).
    """

    def __init__(self) -> None:
        self.time_s = {"wait": 0.0, "upcast": 0.0, "adamw": 0.0, "call": 0.0, "writeback": 0.0,
                       "consumer_wait": 0.0, "zone_wait": 0.0, "backup": 0.0, "idle": 0.0}
        self.updated_numel = 0
        self.earlier_s = 0.0
        # Seconds of pieces run for updates not yet complete, by unit, and their total.
        self._partial: dict[int, float] = {}
        self._partial_s = 0.0

    def reset(self) -> None:
        """Every counter back to zero."""
        self.time_s = dict.fromkeys(self.time_s, 0.0)
        self.updated_numel, self.earlier_s, self._partial_s = 0, 0.0, 0.0
        self._partial.clear()

    def add_sum(self, seconds: float, earlier: bool) -> None:
        """Seconds spent summing landed gradients; ``earlier``: of a micro-batch before the step's last."""
        self.time_s["upcast"] += seconds
        if earlier:
            self.earlier_s += seconds

    def sums_called(self, seconds: float) -> None:
        """Of the seconds :meth:`add_sum` counted, these were the sums' calls beyond their loops:
        moved from ``upcast`` to ``call`` (the work and ``earlier_s`` stay as they were)."""
        self.time_s["upcast"] -= seconds
        self.time_s["call"] += seconds

    def add_second(self, seconds: float) -> None:
        """Seconds of split updates' second passes (AdamW work, run during earlier micro-batches)."""
        self.time_s["adamw"] += seconds
        self.earlier_s += seconds

    def count(self, index: int, times: dict[str, float], done: bool, numel: int) -> None:
        """Add a piece of unit ``index``'s update (seconds per phase); ``done``: the update is
        complete and updated ``numel`` parameters. Pieces of updates under way are kept apart,
        so that :meth:`reading` leaves them out until they finish."""
        spent = 0.0
        for phase, seconds in times.items():
            self.time_s[phase] += seconds
            spent += seconds
        if done:
            self._partial_s -= self._partial.pop(index, 0.0)
            self.updated_numel += numel
        else:
            self._partial[index] = self._partial.get(index, 0.0) + spent
            self._partial_s += spent

    def work_s(self) -> float:
        """Seconds of host work so far (the ``PHASES``), pieces of updates under way included."""
        return sum(self.time_s[phase] for phase in PHASES)

    def reading(self) -> HostReading:
        """The totals now, without the pieces of updates still under way (a window that starts
        mid-update would otherwise count the update's parameters but only some of its seconds)."""
        return HostReading(self.work_s() - self._partial_s, self.updated_numel, self.earlier_s)

    def since(self, start: HostReading) -> HostReading:
        """What :meth:`reading` added since ``start``."""
        now = self.reading()
        return HostReading(now.seconds - start.seconds, now.numel - start.numel, now.earlier_s - start.earlier_s)


class ClockReadings:
    """What the host optimizer's :class:`HostClock` (its ``clock``) has counted, in the forms the
    scheduler and the rehearsal compare with a plan."""

    clock: HostClock

    @property
    def time_s(self) -> dict[str, float]:
        """Seconds spent per phase (:attr:`HostClock.time_s`)."""
        return self.clock.time_s

    @property
    def updated_numel(self) -> int:
        """Parameters updated so far (this rank's shards)."""
        return self.clock.updated_numel

    def measured_s_per_param(self) -> float | None:
        """Seconds per parameter the updates so far took (upcast, AdamW and write-back, which
        under data parallelism includes the weight exchange, and speculative clipping's backups;
        not the waits; a rolled-back update counts twice), the figure the scheduler's profile
        predicts; None before any update."""
        return self.s_per_param_since(HostReading(0.0, 0, 0.0))

    def counters(self) -> HostReading:
        """The clock's totals now, as :meth:`measured_s_per_param` counts them, without waiting
        for queued work (:meth:`HostClock.reading`: updates under way are left out)."""
        return self.clock.reading()

    def s_per_param_since(self, start: HostReading) -> float | None:
        """:meth:`measured_s_per_param` of the updates finished since :meth:`counters` gave
        ``start`` (None where none was)."""
        spent = self.clock.since(start)
        return spent.seconds / spent.numel if spent.numel else None

    def split_since(self, start: HostReading) -> tuple[float, float] | None:
        """:meth:`s_per_param_since` in two parts: (the work once units' last gradients had
        landed, the work for earlier micro-batches: their sums and split updates' second
        passes), each per parameter updated in the window."""
        spent = self.clock.since(start)
        return ((spent.seconds - spent.earlier_s) / spent.numel, spent.earlier_s / spent.numel) if spent.numel else None
