"""Backups for speculative clipping: exact rollback of host updates made before the norm was known.

With ``AdamW(max_grad_norm=..., clip_mode="speculative")`` the host optimizer updates each unit
as its gradient lands, with clip coefficient 1 (SuperOffload's idea: clipping rarely fires late
in training), after copying the unit's fp32 master and moments here. When the step's global norm
turns out above ``max_grad_norm``, the copies go back and the update is re-applied with the true
coefficient. Restoring copies is exact; inverting AdamW in floating point would not be. The
gradient itself needs no copy: a kernel's ``apply(s, 1.0)`` leaves ``grad_source`` as it was, and
its landing zone is not released (``_consumed``) until the step is resolved.

The arena is one flat fp32 buffer (``ShadowModel.backup``), handed out front to back per step in
the order gradients land: the units landing first gain most from overlap. A unit that does not
fit waits for the coefficient, as in ``clip_mode="wait"``.
"""
from __future__ import annotations

import torch

from .shadow import UnitShadow

__all__ = ["Backups"]


class Backups:
    """Copies of units' masters and moments in a flat fp32 arena, reset every step.

    Args:
        arena: the fp32 buffer to take copies in (empty: never speculate).
    """

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena
        self._used = 0
        self._where: dict[int, int] = {}  # unit index -> offset of its copies this step

    def save(self, s: UnitShadow) -> bool:
        """Copy ``s``'s master and moments (and remember its step count) if they fit; False if not."""
        n = s.master.numel()
        if self._used + 3 * n > self.arena.numel():
            return False
        a = self._used
        for k, t in enumerate((s.master, s.exp_avg, s.exp_avg_sq)):
            self.arena[a + k * n:a + (k + 1) * n].copy_(t)
        self._where[s.unit.index] = a
        self._used += 3 * n
        return True

    def restore(self, s: UnitShadow) -> None:
        """Put ``s``'s copies back (its step count is the caller's to put back)."""
        a, n = self._where[s.unit.index], s.master.numel()
        for k, t in enumerate((s.master, s.exp_avg, s.exp_avg_sq)):
            t.copy_(self.arena[a + k * n:a + (k + 1) * n])

    def reset(self) -> None:
        """The step is resolved: the arena is free for the next one."""
        self._used = 0
        self._where.clear()
