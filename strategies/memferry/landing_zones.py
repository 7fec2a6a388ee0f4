"""Where host-homed units' gradients land, and how micro-batches are summed there.

Each host-homed unit has a landing zone in pinned host memory (``grad_stage``); under gradient
accumulation a paired unit has a second (``grad_stage2``), so that two micro-batches' gradients
are summed into the unit's fp32 ``grad_acc`` in one pass (``accumulation.sums_in_pairs``). The
training thread marks a zone taken before its copy is queued (:meth:`LandingZones.take`) and
waits for a zone to be free before reusing it (:meth:`LandingZones.wait_free`); the host
optimizer's worker sums what landed (:meth:`LandingZones.receive`) and frees a zone once it has
read it. A zone that holds a step's only gradient stays taken until that update is published
(the update reads it there: :meth:`LandingZones.free`).

Without clipping (``fuse_last_pair``) a paired unit's step that ends with a pair leaves the pair
to the update, which adds it (and the sum before it, if any) as it reads (``UnitShadow.last_pair``):
8 bytes per parameter fewer than writing the fp32 sum and reading it back. A step of an odd count
(over 2) leaves its last 16-bit micro-batch to the update instead, which adds it to the sum as it
reads them (``UnitShadow.last_alone``, its zone taken until then): 18 bytes read where summing it
alone first and updating from the sum moved 10 + 16. An even count keeps the pair: leaving its
last micro-batch alone too means summing the one before alone (10 bytes while the last runs) to
save 2 in the update; on session 41's H100 host that plan's rehearsed steps took 1473 ms against
1362 with the pair (bench/results/2026-12-06-h100-session41/call2/).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from .host_kernel import HostKernel
from .shadow import UnitShadow

__all__ = ["LandingZones"]


class LandingZones:
    """The landing zones of every unit (by index) and the micro-batches summed from them.

    Args:
        shadows: all units' buffers, by unit index.
        kernel: the host kernel whose ``accumulate`` and ``accumulate_pair`` sum them.
        fuse_last_pair: leave a paired unit's last pair (of an odd count, its last micro-batch) to
            the update (not where anything else reads the step's gradient, e.g. clipping's norm
            or re-application).
        steps: micro-batches per optimizer step (``MemFerry(accumulation_steps=...)``).
    """

    def __init__(self, shadows: list[UnitShadow], kernel: HostKernel, fuse_last_pair: bool = False,
                 steps: int = 1) -> None:
        self.shadows = shadows
        self.kernel = kernel
        self.fuse_last_pair = fuse_last_pair
        self.steps = steps
        # _free[zone][i]: unit i's zone has been read, so the next micro-batch may land there.
        self._free = ([threading.Event() for _ in shadows], [threading.Event() for _ in shadows])
        self.release_all()
        self._received = [0] * len(shadows)  # worker side: micro-batches summed into grad_acc this step
        self._pending: set[int] = set()  # worker side: paired units whose first zone waits for its pair

    # ------------------------------------------------------------------ training side
    def take(self, index: int, zone: int) -> None:
        """Unit ``index``'s ``zone`` is about to receive a gradient."""
        self._free[zone][index].clear()

    def wait_free(self, index: int, zone: int, check: Callable[[], None]) -> None:
        """Block until unit ``index``'s ``zone`` has been read; ``check()`` every half second
        (it raises when the worker has failed)."""
        while not self._free[zone][index].wait(timeout=0.5):
            check()
        check()

    # ------------------------------------------------------------------ worker side
    def receive(self, index: int, final: bool, summed: bool, zone: int) -> float:
        """A landed gradient: sum it into ``grad_acc`` unless it is a step's only one (updated
        from the zone itself) or the whole sum already (``summed``: made on the device); a paired
        unit's first zone waits for the second, and the two are summed in one pass. Returns the
        seconds spent summing."""
        s = self.shadows[index]
        seconds = 0.0
        if summed:
            s.accumulated = True  # grad_acc holds the step's sum, made on the device
        elif final and not self._received[index] and index not in self._pending:
            s.accumulated = False  # one micro-batch: update straight from the landing zone
        elif final and self._leaves_last(s) and self._received[index] == self.steps - 1 and index not in self._pending:
            s.last_alone = zone  # the update adds it to the sum as it reads them; the zone stays taken
            return 0.0
        elif zone == 0 and not final and s.grad_stage2 is not None:
            if index in self._pending:
                raise RuntimeError(f"unit {s.unit.name}: two gradients landed in its first zone without a pair")
            self._pending.add(index)  # summed with the next micro-batch's (zone 1); the zone stays taken
            return 0.0
        elif final and zone == 1 and self.fuse_last_pair and index in self._pending:
            self._pending.discard(index)  # the update sums the pair as it reads it; both zones stay taken
            s.last_pair = True
            return 0.0
        else:
            seconds = self._sum(index, zone)
        if s.accumulated:
            self._free[0][index].set()  # the sum holds it: the next micro-batch may land
        return seconds

    def _leaves_last(self, s: UnitShadow) -> bool:
        """Whether ``s``'s last micro-batch of a full step is left alone to the update, beside
        the sum (a paired unit of 16-bit gradients, an odd count over 2, no clipping): it would
        otherwise be summed alone just before the update."""
        return (self.fuse_last_pair and self.steps > 2 and self.steps % 2 == 1
                and s.grad_stage2 is not None and s.grad_stage.dtype != torch.float32)

    def flush(self) -> tuple[list[int], float]:
        """The step ends before its last micro-batch: sum every first zone whose pair never came.
        Returns the units with something accumulated (to update) and the seconds spent summing."""
        seconds = sum(self._sum(i, 0) for i in sorted(self._pending))
        return [i for i, n in enumerate(self._received) if n], seconds

    def complete(self, index: int) -> None:
        """Unit ``index``'s gradient of the step is complete (its update is due)."""
        self._received[index] = 0

    def free(self, index: int) -> None:
        """Unit ``index``'s update is published: both its zones may receive again."""
        self.shadows[index].accumulated = self.shadows[index].last_pair = False
        self.shadows[index].last_alone = None
        self._free[0][index].set()
        self._free[1][index].set()

    def release_all(self) -> None:
        """Every zone free (at the start, and to release waiters when the worker fails)."""
        for ev in self._free[0] + self._free[1]:
            ev.set()

    def _sum(self, index: int, zone: int) -> float:
        """Sum the gradient in ``zone`` (with the first zone's, when zone 1) into ``grad_acc``."""
        s = self.shadows[index]
        t0 = time.perf_counter()
        first = not self._received[index]
        if zone == 1:
            if index not in self._pending:
                raise RuntimeError(f"unit {s.unit.name}: a gradient landed in its second zone with none in the first")
            self._pending.discard(index)
            self.kernel.accumulate_pair(s.grad_acc, s.grad_stage, s.grad_stage2, init=first)  # one pass for two
            self._received[index] += 2
            self._free[1][index].set()
        else:
            self._pending.discard(index)
            if first:
                s.grad_acc.copy_(s.grad_stage)
            else:
                self.kernel.accumulate(s.grad_acc, s.grad_stage)  # one pass, no fp32 temporary
            self._received[index] += 1
        s.accumulated = True
        self._free[0][index].set()
        return time.perf_counter() - t0
