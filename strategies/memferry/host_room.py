"""Between plans the model cannot tell apart, the one that leaves the host room.

The scheduler's search returns the plan of least predicted step. Where that plan's host work
fills most of its compute chain, its step rests on an overlap the model prices as perfect, and
a host a little slower than profiled (the steps' host rate varied by 5-16 % from the plan's in
the rehearsals of session 34) makes the training thread wait for it. On the H100 (2026-12-05,
bench/results/2026-12-05-h100-session34/) two searches of the starved GPT under 16 GB found
plans 0.4 ms apart: 165.2 ms with 141 ms of host work, which ran at 0.187 s (its rehearsal at
0.195, the training thread waiting 30-62 ms a step for the host), and 165.6 ms with 83 ms of
host work, which ran at 0.1655.

So where the fastest plan is host-tight (its host work at least :data:`HOST_TIGHT` of its
compute chain), the search runs again on a profile whose host is :data:`HOST_SLACK` times
slower; where that finds a plan predicted, on the real profile, within :data:`SLACK_TIE` of the
fastest, within the budget and with less host work, that plan is taken. Its prediction is the
real profile's: the step it is expected to run at is at most :data:`SLACK_TIE` longer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .cost import Links, Prediction, predict
from .host_calibration import calibrated, same_layout

if TYPE_CHECKING:
    from .config import Plan
    from .profiler import StepProfile

__all__ = ["HOST_TIGHT", "HOST_SLACK", "SLACK_TIE", "with_host_room"]

#: Host work at least this share of the compute chain makes a plan host-tight (141 of 165 ms
#: ran 13 % over its prediction; 83 of 165 ms ran at it).
HOST_TIGHT = 0.80
#: How much slower the host is taken to be in the search for a plan with room.
HOST_SLACK = 1.15
#: A plan with room is taken where its predicted step is at most this much (relative) longer.
SLACK_TIE = 0.01


def with_host_room(plan: "Plan", pred: Prediction, profile: "StepProfile", links: Links, budget: float, margin: float,
                   search: Callable[["StepProfile"], "Plan"]) -> tuple["Plan", Prediction, str | None]:
    """``plan`` (predicted ``pred`` on ``profile``), or a plan with more host room predicted as
    fast (see the module docstring), with its prediction on ``profile`` and a note saying why
    (None where ``plan`` stays). ``search``: the scheduler's search on a given profile (raising
    its ``NoPlanFitsError`` where none fits)."""
    if not pred.compute_s or pred.host_optimizer_s < HOST_TIGHT * pred.compute_s:
        return plan, pred, None
    try:
        other = search(calibrated(profile, HOST_SLACK, HOST_SLACK))
    except ValueError:  # NoPlanFitsError: nothing else fits
        return plan, pred, None
    if same_layout(other, plan):
        return plan, pred, None
    theirs = predict(other, profile, links, margin)
    if (theirs.peak_bytes > budget or theirs.step_s > pred.step_s * (1 + SLACK_TIE)
            or theirs.host_optimizer_s >= pred.host_optimizer_s):
        return plan, pred, None
    note = (f"host room: the fastest plan's host work ({pred.host_optimizer_s * 1e3:.1f} ms) filled "
            f"{pred.host_optimizer_s / pred.compute_s:.0%} of its compute chain ({pred.compute_s * 1e3:.1f} ms); a "
            f"search with the host {HOST_SLACK:.2f}x slower found this plan, {theirs.step_s * 1e3:.1f} ms against "
            f"{pred.step_s * 1e3:.1f} ms with {theirs.host_optimizer_s * 1e3:.1f} ms of host work: taken")
    return other, theirs, note
