"""The plan's host rate, checked on the rehearsal step and the plan made again where it was off.

The scheduler prices a host update from the profiler's timing of the kernel alone and beside
back-to-back copies (``host_budget.py``). Inside real steps the same kernel ran 1.05-1.5x slower
on the H200 machine (bench/results/2026-12-03-h200-session12/: the training thread, every
block's copies and the device's gradient writes share the host with it, in a mix the
profile's two timings do not reproduce), so a host-bound plan's predicted step was up to 30 %
short, and the scheduler chose between plans on that optimistic figure.

The rehearsal step (``rehearsal.py``) runs the plan's host work for real, and the host
optimizer's clock (``host_clock.py``) keeps its two parts apart: the work once a unit's last
gradient has landed (the update, which the next forward may wait for) and the sums of the step's
earlier micro-batches (which run while later ones compute). This module compares each with what
the plan assumed (:func:`ratios`); the profile is calibrated to the measured ratios
(``StepProfile.host_update_scale`` and ``host_earlier_scale`` scale the cost model's host-memory
bytes of each part; what a copy byte costs stays) and the plan is priced again on it
(:func:`repriced`). One ratio for both parts
priced the update too cheaply where it matters: on the H200 the update ran 1.00-1.38x its price
inside steps of 8 micro-batches while the sums ran 0.73-1.13x theirs, and with a single ratio
the step of a plan bound by the host was predicted 6-12 % short (−7.3 to +0.8 % with two:
bench/results/2026-12-04-h200-session21/). Within :data:`TOLERANCE` that is all (the same
plan, its prediction on the measured rates). Beyond it, and only where that moves its plan's
predicted step by more than :data:`SEARCH_AGAIN` (the host bounds it), the scheduler searches
again, without profiling again; its plan replaces the old one only when predicted faster by more
than :data:`SEARCH_AGAIN` (on the H200 a search of 24 blocks takes tens of seconds, and a new
plan means building the engine again). The plan's notes keep the uncalibrated prediction beside
the new one. Calibration happens once per engine: a second plan's rate is not checked again.
Not on virtual devices (the cpu backend): there the "device" computes on the same cores as the
host updates, and a step's rate says nothing a profile could keep.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from .config import Plan

if TYPE_CHECKING:
    from xpu import Backend

    from .links import Links
    from .profiler import StepProfile

__all__ = ["TOLERANCE", "SEARCH_AGAIN", "applies", "ratios", "least_disturbed", "calibrated", "with_sends", "repriced",
           "same_layout"]

#: Measured over planned host rate beyond which the scheduler may search again (either way).
TOLERANCE = 1.10
#: Relative change of a predicted step worth a new search, and a new plan's least gain over the old.
SEARCH_AGAIN = 0.02


def applies(backend: "Backend") -> bool:
    """Whether a rehearsal on ``backend`` checks the host rate (real devices only: see the module)."""
    return not backend.caps.virtual_devices


def ratios(plan: Plan, measured: tuple[float, float]) -> tuple[float, float]:
    """Measured over planned seconds per parameter of the update and of the earlier sums, from
    ``measured`` = (update, earlier sums) as ``HostOptimizer.split_since`` gives them; 1 for a
    part the plan prices at nothing or the rehearsal did not see. Where the plan prices no sums
    apart (a profile without the host-memory model prices all host work as updates), the
    measured sums count with the updates."""
    planned_update, planned_earlier = plan.host_update_s_per_param, plan.host_earlier_s_per_param or 0.0
    update, earlier = measured
    if planned_earlier <= 0:
        update, earlier = update + earlier, 0.0
    return (update / planned_update if planned_update > 0 and update > 0 else 1.0,
            earlier / planned_earlier if planned_earlier > 0 and earlier > 0 else 1.0)


def least_disturbed(found: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The least of each part's :func:`ratios` over the timed rehearsals of one fit, each measured
    against the plan it rehearsed. A disturbance only slows the host, and rebuilding the engine for
    a plan that peaked over the budget disturbs it: it frees the old shadow's pinned buffers and
    pins the new one's. The 128-layer GPT's host updates ran 1.00x their price in its first
    rehearsal, 1.22x in the one after such a rebuild, and 1.04x in its steps (H100,
    bench/results/2026-12-05-h100-session35/call2/s128)."""
    return min(r[0] for r in found), min(r[1] for r in found)


def calibrated(profile: "StepProfile", update: float, earlier: float = 1.0) -> "StepProfile":
    """``profile`` with its host work priced ``update`` times as long once the last gradient has
    landed and ``earlier`` times as long for the earlier micro-batches' sums."""
    note = f"host work scaled to the rehearsal's: updates {update:.2f}x, earlier micro-batches' sums {earlier:.2f}x"
    return dataclasses.replace(profile, host_update_scale=profile.host_update_scale * update,
                               host_earlier_scale=profile.host_earlier_scale * earlier, notes=[*profile.notes, note])


def with_sends(profile: "StepProfile", send_s: float) -> "StepProfile":
    """``profile`` with the issuing thread's ``send_s`` seconds per gradient send before a step's
    last micro-batch (``StepProfile.earlier_send_s``: in series with a host-summing block's
    backward there). On the H200 host-summing plans ran over their predictions by 7/8 of the
    thread's send time, 0.6-0.7 ms a send, and device-summing ones did not
    (bench/results/2026-12-04-h200-session24/)."""
    note = f"sends before a step's last micro-batch: {send_s * 1e3:.2f} ms each on the issuing thread"
    return dataclasses.replace(profile, earlier_send_s=send_s, notes=[*profile.notes, note])


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
