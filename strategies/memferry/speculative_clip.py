"""Speculative clipping: host updates made before the norm was known, kept or re-applied exactly.

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

:class:`ClipSpeculation` is the host optimizer's worker side of it: which units are speculated,
in what order, and what the coefficient does to each once it is known.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from xpu.spans import span

from .clip_norms import GlobalNormClip, PendingClip, clips
from .host_kernel import HostKernel, Triple
from .shadow import UnitShadow

if TYPE_CHECKING:
    from .config import AdamW
    from .host_clock import HostClock
    from .host_tasks import TaskBoard
    from .split_update import SplitUpdates

__all__ = ["Backups", "Held", "swap_state", "ClipSpeculation"]


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


class ClipSpeculation:
    """The host optimizer's worker under clipping (``HostOptimizer`` inherits it): each unit's
    complete gradient held for the step's coefficient (:meth:`_hold`), speculative updates made
    a piece at a time while nothing more urgent waits (:meth:`_speculate_piece`), and, once the
    coefficient is known, each one kept or re-applied from its old values (:meth:`_resolve`).
    Worker side only; it reads the host optimizer's attributes annotated here."""

    cfg: "AdamW"
    shadows: list[UnitShadow]
    kernel: HostKernel
    clock: "HostClock"
    _clip: GlobalNormClip | None
    _board: "TaskBoard"
    _split: "SplitUpdates"
    _lr: float
    _count: Callable[[int, dict[str, float], bool], None]
    _update: Callable[..., None]
    _publish: Callable[[int], None]

    def _start_clipping(self, backup: torch.Tensor | None) -> None:
        """The clipping state, empty; ``backup``: the arena of speculative updates' spares."""
        # This step's units in landing order; those waiting to be speculated; the one being
        # speculated; how many units the last step had (the last to land is not speculated).
        self._order: list[Held] = []
        self._to_speculate: list[Held] = []
        self._running: Held | None = None
        self._expect: int | None = None
        self._backups = (Backups(backup if backup is not None else torch.empty(0), twins=not self.kernel.binds_state)
                         if self.cfg.speculative else None)
        #: speculative clipping, totals so far (worker side; read them with ``clip_counts``):
        #: ``steps`` finished with clipping on, ``rollback_steps`` among them that re-applied
        #: updates from backups, ``speculated_units``, ``rolled_back_units``, ``held_units`` (no
        #: backup room), ``direct_units`` (updated once the coefficient was known: the unit landing
        #: last, or one whose speculation had not started), ``sure_units`` (among those, units not
        #: speculated because the step's running norm already made it clip).
        self.clip_stats = {"steps": 0, "rollback_steps": 0, "speculated_units": 0, "rolled_back_units": 0,
                           "held_units": 0, "direct_units": 0, "sure_units": 0}
        # This step's squared norm so far: the host's (per unit, summed exactly), the device's, whether it clips.
        self._sq_terms: list[float] = []
        self._device_sq, self._sure = 0.0, False

    def _hold(self, index: int) -> None:
        """Unit ``index``'s gradient of the step is complete: add it to the norm and hold its
        update for the coefficient, queued for a speculative update unless the step is sure to
        clip or it is the step's last expected."""
        s = self.shadows[index]
        if self._clip is None or index not in self._clip.device_normed:
            self._sq_terms.append(self.kernel.sqnorm(s.grad_source))
        else:  # the device's running sum so far (landed with this gradient, after every earlier one)
            self._device_sq = float(self._clip.partials[index])
        max_norm = self._clip.max_norm if self._clip is not None else self.cfg.max_grad_norm  # suspended: inf
        if not self._sure and clips(self._device_sq + math.fsum(self._sq_terms), max_norm):
            self._sure = True  # whatever comes later: speculating now would only be re-applied
            self.clip_stats["sure_units"] += len(self._to_speculate)
            self._to_speculate.clear()
        held = Held(index)
        self._order.append(held)
        if self._backups is not None and (self._expect is None or len(self._order) < self._expect):
            if self._sure:
                self.clip_stats["sure_units"] += 1
            else:
                self._to_speculate.append(held)

    def _speculate_piece(self) -> None:
        """One piece of a speculative update: start the next queued unit's if none is under way
        (taking backup room, or leaving the unit held where there is none; a split unit's first
        pass changes no state, so it needs none)."""
        if self._running is None:  # in landing order, or the unit the next forward needs first
            deadline, waiting = self._board.deadline, self._to_speculate
            held = waiting.pop(0 if deadline is None
                               else min(range(len(waiting)), key=lambda k: deadline(waiting[k].index)))
            s = self.shadows[held.index]
            if self._split.splits(held.index):
                held.lr, held.pieces = self._lr, self._split.first(held.index)
            else:
                room = self._backups.reserve(s)
                if room is None:
                    held.no_room = True
                    self.clip_stats["held_units"] += 1
                    return
                held.old, where = self._backups.begin(s, room)
                held.lr, held.pieces = self._lr, self.kernel.pieces(s, 1.0, **where)
            self._running = held
            self.clip_stats["speculated_units"] += 1
        held = self._running
        s = self.shadows[held.index]
        with span(lambda: f"optimizer:host speculative {s.unit.name}"):
            times = next(held.pieces, None)
        if times is None:
            held.pieces, self._running = None, None
            self._count(held.index, {}, done=True)
            return
        self._count(held.index, times, done=False)

    def _finish_running(self) -> None:
        """Complete the speculative update under way, if any."""
        while self._running is not None:
            self._speculate_piece()

    def _resolve(self, coef: float | PendingClip) -> None:
        """The clip coefficient is known (or about to be: a ``PendingClip`` is waited for): keep
        speculative updates that used coefficient 1 and the current rate, re-apply the others from
        their backups, and update the rest once (exactly what ``clip_mode="wait"`` computes), in
        the order the next forward needs them: ``rest`` first with deadlines (re-applied last, it
        held the forward until all were done), else (and under data parallelism) by index."""
        if isinstance(coef, PendingClip):
            coef = coef.coef()
        self._finish_running()
        self._to_speculate.clear()
        rolled, need = 0, self._board.deadline
        for held in sorted(self._order, key=lambda h: need(h.index) if need else h.index):
            s = self.shadows[held.index]
            if self._split.splits(held.index):
                rolled += self._resolve_split(held, coef)
            elif held.lr is None:
                self.clip_stats["direct_units"] += int(self._backups is not None and not held.no_room)
                self._update(held.index, coef)
            elif coef == 1.0 and held.lr == self._lr:
                self._publish(held.index)
            else:  # re-apply in one sweep, from the old values
                s.step -= 1
                self.kernel.sync_step(s)
                rolled += 1
                self._update(held.index, coef, source=held.old)
            if held.old is not None:
                self._backups.release(s, held.old)
        self._expect = len(self._order)
        self._order, self._sq_terms, self._device_sq, self._sure = [], [], 0.0, False
        self.clip_stats["steps"] += 1
        self.clip_stats["rollback_steps"] += int(rolled > 0)
        self.clip_stats["rolled_back_units"] += rolled

    def _resolve_split(self, held: Held, coef: float) -> int:
        """A split unit's update, as :meth:`_resolve`'s for the others but with nothing to restore
        (a first pass changes no state); its second pass queued. Returns 1 if it was made again."""
        index = held.index
        redo = held.lr is not None and not (coef == 1.0 and held.lr == self._lr)
        if held.lr is None or redo:
            self.clip_stats["direct_units"] += int(held.lr is None and self._backups is not None)
            with span(lambda: f"optimizer:host {self.shadows[index].unit.name}"):
                self._count(index, self._split.copy_now(index, coef), done=True)
        self._publish(index)
        self._split.queue(index)
        return int(redo)
