"""Split updates: the working copy first, the fp32 master and moments later.

Under gradient accumulation every host-updated unit's update waits for the step's last
micro-batch, whose backward lands the first blocks' gradients last; the next forward needs those
blocks first. On an H100 the accumulation-8 GPT's training thread waited 267 ms a step for its
updates (bench/results/2026-12-06-h100-session39/call4/acc8). But the next forward reads only
the working copy. With ``AdamW(split_update=True)`` the host optimizer updates such a unit in two
passes (``HostKernel.split``):

1. **First pass**, as soon as the last gradient has landed, in the next forward's order: the
   update computed in full, but only the working copy written, and the step's whole gradient in
   fp32 (``UnitShadow.grad_pending``). After a last pair summed as it is read that is 26 B a
   parameter instead of the update's 34 (after an odd count's last micro-batch, 24 instead of
   32). The unit is then published: the next forward may read it and its landing zones take the
   next micro-batches.
2. **Second pass**, while nothing more urgent has landed (the next step's earlier micro-batches
   leave the host room): the same update again, in place from the fp32 gradient, writing the
   master and moments and no working copy (28 B). It uses the step and learning rate of the
   first, so the two together are bit-equal to one pass.

A unit's second pass ends before anything reads or writes what it does: its next first pass
(:meth:`SplitUpdates.finish`), every caller of ``HostOptimizer.wait_all`` (checkpoints, an
out-of-memory re-plan), a reset of the host clock and the worker's stop (``close``): all of
those drain them (:meth:`SplitUpdates.drain`). Only units with a
``grad_pending`` buffer split (``ShadowModel(split=True)``: 16-bit compute, accumulation), only
with a kernel that :attr:`~.host_kernel.HostKernel.splits`, and never under data parallelism
(whose updates are published by an exchange of shards).

With clipping the first pass is the update that waits for the coefficient, or that speculates
with coefficient 1 (``clip_mode="speculative"``). It changes no state, so a step whose clip fires
just makes it again with the coefficient (22 B a parameter, from the fp32 sum) where a one-pass
update is re-applied from its backup (28 B), and a split unit needs no backup room (so with the
``torch`` kernel, which does not split, those units' clipped updates wait for the coefficient).
The second pass then scales the pending gradient by the same coefficient.

The cost model prices the second pass with the earlier micro-batches' sums
(``host_budget.update_bytes(split=True)``); a second fp32 gradient per unit is what lets it wait
a whole step (bench/results/2026-12-06-cpu-session39/weights-first.md sized the gain with the
cost model: 3.8-6.8 % of the step on the plans session 39 trained).

Measured (bench/results/2026-12-06-h100-session40/): without clipping it lost 1.2 % on the §3
GPT with accumulation 8 (its first pass ran at 0.216 ns a parameter against the one pass's
0.2245: both read the same 20 B); with clipping it won 3.3-3.9 % by the mean on the HF model, on
two hosts. So it is on by default only where clipping is (:func:`updates_split`).
"""
from __future__ import annotations

import time
from typing import Iterator

from .config import AdamW
from .host_clock import HostClock
from .host_kernel import HostKernel
from .host_loops import UnavailableError, host_loops
from .shadow import UnitShadow

__all__ = ["SplitUpdates", "updates_split"]


def updates_split(cfg: AdamW, data_parallel: bool) -> bool:
    """Whether this run's host updates split (``AdamW.splits``): never under data parallelism.
    By default (``split_update=None``) only where the single-pass loops build here: the torch
    kernel does not split, and a unit sized to split has no backup room, so under speculative
    clipping its updates would wait for the coefficient. ``split_update=True`` is kept as asked."""
    if data_parallel or not cfg.splits:
        return False
    if cfg.split_update is None:
        if cfg.host_kernel == "torch":
            return False
        try:
            host_loops()
        except UnavailableError:
            return False
    return True


class SplitUpdates:
    """The units whose updates split, and their second passes waiting to run (worker side).

    Args:
        kernel: the host kernel (``split`` where it :attr:`~.host_kernel.HostKernel.splits`).
        shadows: all units' buffers, by unit index.
        enabled: :func:`updates_split`, the rule the shadow's ``grad_pending`` buffers were
            sized by.
    """

    def __init__(self, kernel: HostKernel, shadows: list[UnitShadow], enabled: bool) -> None:
        self.kernel = kernel
        self.shadows = shadows
        self.units = frozenset(i for i, s in enumerate(shadows)
                               if enabled and kernel.splits and s.grad_pending is not None and not s.master_is_work)
        self._made: dict[int, Iterator[dict[str, float]]] = {}  # second passes whose first is under way
        self._queue: dict[int, Iterator[dict[str, float]]] = {}  # ready to run, oldest first

    def splits(self, index: int) -> bool:
        """Whether unit ``index``'s updates split."""
        return index in self.units

    def first(self, index: int, coef: float = 1.0, whole: bool = False) -> Iterator[dict[str, float]]:
        """Unit ``index``'s first pass with its gradient scaled by ``coef``, a piece at a time
        (it sets ``copied`` to its step with the last); its second is made now, with the same
        step, rate and coefficient, and waits for :meth:`queue` (or :meth:`discard`)."""
        s = self.shadows[index]
        if index in self._made or index in self._queue:
            raise RuntimeError(f"unit {s.unit.name}: a split update began before the last one's second pass ended")
        # Not copied for the coming step yet: after a checkpoint is loaded, ``copied`` may already
        # hold that step's number from before, and the first piece would look like the last.
        s.copied = s.step
        first, self._made[index] = self.kernel.split(s, s.grad_pending, whole, coef)
        return first

    def copy_now(self, index: int, coef: float) -> dict[str, float]:
        """Unit ``index``'s first pass with ``coef``, whole, now (a second pass made before it is
        dropped: :meth:`discard`); its seconds per phase."""
        self.discard(index)
        total: dict[str, float] = {}
        for piece in self.first(index, coef, whole=True):
            total = {k: total.get(k, 0.0) + v for k, v in piece.items()}
        return total

    def discard(self, index: int) -> None:
        """Forget unit ``index``'s second pass made with its first (a speculative first pass to be
        made again with the clip coefficient), if any."""
        self._made.pop(index, None)

    def queue(self, index: int) -> None:
        """Unit ``index``'s first pass is done: its second may run."""
        self._queue[index] = self._made.pop(index)

    def waiting(self) -> bool:
        """Whether a second pass is ready to run."""
        return bool(self._queue)

    def piece(self, clock: HostClock) -> None:
        """One piece of the oldest ready second pass (its seconds count as work for earlier
        micro-batches: ``HostClock.add_second``)."""
        index = next(iter(self._queue))
        t0 = time.perf_counter()
        if next(self._queue[index], None) is None:
            del self._queue[index]
        clock.add_second(time.perf_counter() - t0)

    def finish(self, index: int, clock: HostClock) -> None:
        """Run unit ``index``'s second pass to its end, if one is waiting."""
        pieces = self._queue.pop(index, None)
        if pieces is not None:
            t0 = time.perf_counter()
            for _ in pieces:
                pass
            clock.add_second(time.perf_counter() - t0)

    def drain(self, clock: HostClock) -> None:
        """Run every waiting second pass to its end (the state is then whole)."""
        for index in list(self._queue):
            self.finish(index, clock)
