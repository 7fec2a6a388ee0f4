"""What a ``MemFerry`` engine reports while it trains: clipping's norms and counts, and the host
optimizer's rate against the plan's (``MemFerry`` inherits :class:`EngineReadings`)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .clip_norms import GlobalNormClip
    from .config import Plan
    from .host_optimizer import HostOptimizer

__all__ = ["EngineReadings"]

_log = logging.getLogger("xpu.memferry")

#: The host AdamW rate may differ from the plan's by this factor before the engine warns.
_RATE_TOLERANCE = 1.25
#: ... and only where that difference, over a step's host-updated parameters, is at least this
#: share of the predicted step (a LoRA's few host parameters update in per-call overheads far
#: from any per-parameter rate, which moves no step).
_STEP_SHARE = 0.05


class EngineReadings:
    """The engine's readings (see the module); reads the engine's attributes annotated here."""

    clip: "GlobalNormClip | None"
    optimizer: "HostOptimizer"
    plan: "Plan"

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None: no step yet, or no
        clipping, which measures no norm); may wait for the step's backward to end."""
        return self.clip.last_norm if self.clip is not None else None

    @property
    def clipped_steps(self) -> int:
        """Steps whose clip coefficient was below 1 (clipping fired)."""
        return self.clip.clipped_steps if self.clip is not None else 0

    def clip_stats(self) -> dict[str, int]:
        """Clipping so far: ``clipped_steps`` (coefficient below 1), and from the host optimizer
        (see ``AdamW.clip_mode``) ``steps``, ``rollback_steps`` (steps whose speculative updates
        were restored and re-applied: the clipped ones, plus any whose learning rate changed
        between backward and :meth:`step`), ``speculated_units``, ``rolled_back_units`` and
        ``held_units`` (no backup room: they waited). Waits for queued host work."""
        return {"clipped_steps": self.clipped_steps, **self.optimizer.clip_counts()}

    @property
    def grad_norm_history(self) -> list[tuple[float, float]]:
        """``(global norm before clipping, clip coefficient)`` of each step so far, oldest first
        (empty without clipping; the rehearsal's are forgotten). Waits for the last step's."""
        return self.clip.history if self.clip is not None else []

    def host_rate(self) -> tuple[float | None, float | None]:
        """``(measured, planned)`` host AdamW seconds per parameter: what this engine's updates
        took so far, and what the scheduler's profile assumed (None without ``plan="auto"``)."""
        return self.optimizer.measured_s_per_param(), self.plan.host_s_per_param

    def _check_host_rate(self) -> None:
        """Say once, after a few steps, when the host optimizer runs far from the rate the plan
        assumed and that moves the step: the predicted step time is then off by up to that much
        host work."""
        measured, planned = self.host_rate()
        if measured is None or not planned:
            return
        ratio = measured / planned
        if 1 / _RATE_TOLERANCE <= ratio <= _RATE_TOLERANCE:
            return
        step = self.plan.predicted_step_s
        per_step = sum(s.master.numel() for s in self.optimizer.shadows)  # host-updated parameters a step
        differs = abs(measured - planned) * per_step
        if step and differs < _STEP_SHARE * step:
            return
        _log.warning("MemFerry: the host optimizer ran at %.3f ns per parameter over the first steps, %.2fx the "
                     "%.3f ns the scheduler's profile measured (%.1f ms a step %s); the plan's predicted step (%s) "
                     "is %s for the host-updated units", measured * 1e9, ratio, planned * 1e9, differs * 1e3,
                     "more" if ratio > 1 else "less", f"{step * 1e3:.1f} ms" if step else "none",
                     "optimistic" if ratio > 1 else "pessimistic")
