"""Backups for speculative clipping: exact rollback of host updates made before the norm was known.

With ``AdamW(max_grad_norm=..., clip_mode="speculative")`` the host optimizer updates each unit
as its gradient lands, with clip coefficient 1 (SuperOffload's idea: clipping rarely fires late
in training), writing the unit's old fp32 master and moments here in the same sweep. When the
step's global norm turns out above ``max_grad_norm``, the update is re-applied from these copies
with the true coefficient, again in one sweep (``HostKernel.pieces``'s ``save`` and ``source``).
Restoring copies is exact; inverting AdamW in floating point would not be. The gradient itself
needs no copy: a kernel's update leaves ``grad_source`` as it was, and its landing zone is not
released (``_consumed``) until the step is resolved.

The arena is one flat fp32 buffer (``ShadowModel.backup``), handed out front to back per step in
the order gradients land: the units landing first gain most from overlap. A unit that does not
fit waits for the coefficient, as in ``clip_mode="wait"``.
"""
from __future__ import annotations

import torch

from .host_kernel import Triple
from .shadow import UnitShadow

__all__ = ["Backups"]


class Backups:
    """Room for units' masters and moments in a flat fp32 arena, handed out anew every step.

    Args:
        arena: the fp32 buffer to take copies in (empty: never speculate).
    """

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena
        self._used = 0
        self._where: dict[int, int] = {}  # unit index -> offset of its copies this step

    def reserve(self, s: UnitShadow) -> Triple | None:
        """Room for ``s``'s master, exp_avg and exp_avg_sq this step, or None if it does not fit."""
        n = s.master.numel()
        if self._used + 3 * n > self.arena.numel():
            return None
        self._where[s.unit.index] = self._used
        self._used += 3 * n
        return self.slot(s)

    def slot(self, s: UnitShadow) -> Triple:
        """The room :meth:`reserve` gave ``s`` this step."""
        a, n = self._where[s.unit.index], s.master.numel()
        return tuple(self.arena[a + k * n:a + (k + 1) * n] for k in range(3))

    def reset(self) -> None:
        """The step is resolved: the arena is free for the next one."""
        self._used = 0
        self._where.clear()
