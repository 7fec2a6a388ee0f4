"""Room for speculative clipping: exact rollback of host updates made before the norm was known.

With ``AdamW(max_grad_norm=..., clip_mode="speculative")`` the host optimizer updates each unit
as its gradient lands, with clip coefficient 1 (SuperOffload's idea: clipping rarely fires late
in training). When the step's global norm turns out above ``max_grad_norm``, the update is
re-applied from the unit's old fp32 master and moments with the true coefficient, in one sweep
(``HostKernel.pieces``'s ``source``). Re-applying from the old values is exact; inverting AdamW
in floating point would not be. The gradient itself needs no copy: a kernel's update leaves
``grad_source`` as it was, and its landing zone is not released until the step is resolved.

Where the old values wait depends on the unit:

* **a twin** (16-bit compute, the fp32 master is a buffer of its own): the update reads the
  unit's state and writes the new one into a spare triple of the same size, which becomes the
  unit's state (:func:`swap_state`); the old triple, untouched, is what a rollback reads and
  the spare of the next step. Nothing is copied: 28 B per parameter, as without clipping.
* **a backup** (fp32 compute: the master *is* the working copy the device loads, so it must be
  updated in place): the old master and moments are written to the spare in the update's own
  sweep (``save``), 12 B per parameter more.

The spares come from one flat fp32 arena (``ShadowModel.backup``), taken front to back in the
order gradients first land (the units landing first gain most from overlap); a unit keeps its
spare from then on. A unit that finds no room waits for the coefficient, as in
``clip_mode="wait"``. :meth:`Backups.restore` puts every unit's state back in its own buffers
before the shadow gives them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .host_kernel import Triple
from .shadow import UnitShadow

__all__ = ["Backups", "Held", "swap_state"]


@dataclass
class Held:
    """A unit of this step whose update is published only when the clip coefficient is known."""

    index: int
    #: the learning rate of its speculative update (made or under way); None: not updated yet
    lr: float | None = None
    #: its speculative update's remaining pieces while under way
    pieces: Iterator[dict[str, float]] | None = None
    #: no backup room was left for it
    no_room: bool = False
    #: where its old master and moments wait while the step is unresolved (:class:`Backups`)
    old: Any = None


def swap_state(s: UnitShadow, new: Triple) -> Triple:
    """Make ``new`` the master, exp_avg and exp_avg_sq of ``s``; return the previous three."""
    old = (s.master, s.exp_avg, s.exp_avg_sq)
    s.master, s.exp_avg, s.exp_avg_sq = new
    return old


class Backups:
    """Each speculating unit's spare master, exp_avg and exp_avg_sq (see the module).

    Args:
        arena: the fp32 buffer spares are cut from (empty: never speculate).
        twins: whether units may update into their spares (False: every unit is backed up,
            for a kernel that keeps its own references to the units' buffers: ``binds_state``).
    """

    def __init__(self, arena: torch.Tensor, twins: bool = True) -> None:
        self.arena = arena
        self.twins = twins
        self._used = 0
        self._spare: dict[int, Triple] = {}  # unit index -> its spare, while no update holds it
        self._own: dict[int, Triple] = {}  # unit index -> the buffers it came with (twins only)

    def reserve(self, s: UnitShadow) -> Triple | None:
        """``s``'s spare for this step's update (cut from the arena the first time), or None if
        the arena has no room left for it. Give it back with :meth:`release`."""
        spare = self._spare.pop(s.unit.index, None)
        if spare is not None:
            return spare
        n = s.master.numel()
        if self._used + 3 * n > self.arena.numel():
            return None
        a = self._used
        self._used += 3 * n
        return tuple(self.arena[a + k * n:a + (k + 1) * n] for k in range(3))

    def twin(self, s: UnitShadow) -> bool:
        """Whether ``s`` updates into its spare (its master is not the working copy itself)."""
        return self.twins and not s.master_is_work

    def begin(self, s: UnitShadow, room: Triple) -> tuple[Triple, dict]:
        """Start ``s``'s speculative update with ``room`` (from :meth:`reserve`): returns the
        triple that holds the old values afterwards and the kernel arguments (``source`` for a
        twin, ``save`` for a backup)."""
        if not self.twin(s):
            return room, {"save": room}
        self._own.setdefault(s.unit.index, (s.master, s.exp_avg, s.exp_avg_sq))
        old = swap_state(s, room)
        return old, {"source": old}

    def release(self, s: UnitShadow, old: Triple) -> None:
        """The step is resolved: ``old`` (what :meth:`begin` returned) is ``s``'s spare again."""
        self._spare[s.unit.index] = old

    def restore(self, shadows: list[UnitShadow]) -> None:
        """Put each twin unit's state back in the buffers it came with (copying where it now
        lives in the arena), so that the shadow releases what it allocated."""
        for s in shadows:
            own = self._own.get(s.unit.index)
            if own is None or own[0].data_ptr() == s.master.data_ptr():
                continue
            for mine, now in zip(own, (s.master, s.exp_avg, s.exp_avg_sq)):
                mine.copy_(now)
            swap_state(s, own)
        self._own.clear()
        self._spare.clear()
