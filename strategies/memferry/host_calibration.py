"""The plan's host rate, checked on the rehearsal step and the plan made again where it was off.

The scheduler prices a host update from the profiler's timing of the kernel alone and beside
back-to-back copies (``host_budget.py``). Inside real steps the same kernel ran 1.05-1.5x slower
on the H200 machine (bench/results/2026-12-03-h200-session12/: the training thread, every
block's copies and the device's gradient writes share the host with it, in a mix the
profile's two timings do not reproduce), so a host-bound plan's predicted step was up to 30 %
short, and the scheduler chose between plans on that optimistic figure.

The rehearsal step (``rehearsal.py``) runs the plan's host updates for real. This module
compares their measured rate with the rate the plan assumed for that step; where the two
differ by more than :data:`TOLERANCE`, the profile's host timings are scaled by the measured
ratio (the kernel's weight in host memory scales with it; what a copy byte costs stays) and the
plan is priced again on the calibrated profile (:func:`repriced`). Only where that moves its
predicted step by more than :data:`SEARCH_AGAIN` (the host bounds it) does the scheduler search
again, without profiling again; its plan replaces the old one only when predicted faster by more
than :data:`SEARCH_AGAIN` (on the H200 a search of 24 blocks takes tens of seconds, and a new
plan means building the engine again). The plan's notes keep the uncalibrated prediction beside
the new one. Calibration happens once per engine: a second plan's rate is not checked again.
Not on virtual devices (the cpu backend): there the "device" computes on the same cores as the
host updates, and a step's rate says nothing a profile could keep.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .config import Plan

if TYPE_CHECKING:
    from xpu import Backend

    from .links import Links
    from .profiler import StepProfile

__all__ = ["TOLERANCE", "SEARCH_AGAIN", "applies", "calibrated", "repriced", "same_layout"]

#: Measured over planned host rate beyond which the plan is priced again (either way).
TOLERANCE = 1.10
#: Relative change of a predicted step worth a new search, and a new plan's least gain over the old.
SEARCH_AGAIN = 0.02


def applies(backend: "Backend") -> bool:
    """Whether a rehearsal on ``backend`` checks the host rate (real devices only: see the module)."""
    return not backend.caps.virtual_devices


def calibrated(profile: "StepProfile", ratio: float) -> "StepProfile":
    """``profile`` with its host kernel's timings (alone and beside copies) ``ratio`` times as long."""
    note = f"host AdamW timings scaled by {ratio:.2f} to the rehearsal step's measured rate"
    return dataclasses.replace(profile, host_adamw_s_per_param=profile.host_adamw_s_per_param * ratio,
                               host_adamw_copies_s_per_param=profile.host_adamw_copies_s_per_param * ratio,
                               notes=[*profile.notes, note])


def repriced(plan: Plan, profile: "StepProfile", links: "Links", margin: float) -> Plan:
    """``plan``'s layout priced on ``profile`` (a calibrated one): a new :class:`Plan` with its
    predicted step, peak and host rate (as the scheduler prices its plans), and ``profile``; the
    notes stay."""
    from .scheduler import price

    again = dataclasses.replace(plan, units=list(plan.units), notes=list(plan.notes))
    price(again, profile, links, margin)
    return again


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether the two plans build the same engine (units, prefetch depth, rest's optimizer)."""
    return (a.units, a.prefetch_depth, a.rest_optimizer) == (b.units, b.prefetch_depth, b.rest_optimizer)
