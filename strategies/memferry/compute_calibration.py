"""The device's compute, checked on the rehearsal's steps: the profile's compute times scaled where
a step the device's compute bounds ran off its price.

The profiler times each block alone, issued back to back (``profiler.py``). Inside real steps
the same blocks can run slower: the executor's hooks, the host optimizer's thread and the copies
share the issuing thread's core, and a block of many small kernels (LoRA's adapters) waits on
its issuing. On the HF Qwen2-1.5B shape with LoRA under 8 GB a compute-bound step ran 2.836 s
against 2.543 predicted (−10.3 %), its rehearsal's steps already 2.765 s, the training thread
waiting at most 2.2 ms a step for the host (H100, bench/results/2026-12-08-h100-session57/;
12 % over on session 56's lease). The host's rates are calibrated on the rehearsal
(``host_calibration.py``); this is the same for the device's compute: where the cost model's
compute chain makes the plan's predicted step (:data:`SHARE`) and its settled rehearsal ran more
than :data:`TOLERANCE` off the prediction, every compute time of the profile (blocks, the eager
figures of compiled ones, the rest) is scaled so the plan is priced at the rehearsed step
(:func:`compute_scale`, :func:`scaled`), and searched again on them where its step moved. The
plan's notes keep the prediction before it. Not on virtual devices (the cpu backend), as for
the host's rates: there the "device" and the host share the cores.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .cost import predict
from .pass_timing import TIME_FIELDS

if TYPE_CHECKING:
    from .config import Plan
    from .links import Links
    from .profiler import BlockProfile, StepProfile

__all__ = ["SHARE", "TOLERANCE", "LIMIT", "compute_scale", "scaled"]

#: The least share of a plan's predicted step its device compute chain must make for the device's
#: compute to be what bounds it (a host term a few percent over the chain, its last updates' tail
#: after backward, is still the chain's pace).
SHARE = 0.95
#: A compute-bound rehearsed step over (or under) its prediction within this ratio leaves the
#: profile as it is: two profiles of one block differ by a few percent.
TOLERANCE = 1.03
#: The most the profile's compute times are scaled either way: beyond it the rehearsal is not
#: believed to say what the device computes at (a disturbed lease, a step bound by something else).
LIMIT = 1.5


def compute_scale(plan: "Plan", profile: "StepProfile", links: "Links", margin: float,
                  step_s: float | None) -> float | None:
    """The factor on ``profile``'s compute times at which ``plan`` is priced at ``step_s`` (a
    rehearsal's step, timed with the host undisturbed), within :data:`LIMIT` either way; None where
    the device's compute chain makes less than :data:`SHARE` of the plan's predicted step (the
    host or a link bounds it), nothing was timed, or the step is within :data:`TOLERANCE` of its
    price."""
    before = predict(plan, profile, links, margin)
    if not step_s or before.step_s <= 0 or before.compute_s < SHARE * before.step_s:
        return None
    if 1 / TOLERANCE <= step_s / before.step_s <= TOLERANCE:
        return None
    scale, step = 1.0, before.step_s
    for _ in range(4):  # the step grows a little slower than its compute (copies stay): converges in a few
        scale = min(LIMIT, max(1 / LIMIT, scale * step_s / step))
        step = predict(plan, scaled(profile, scale), links, margin).step_s
        if abs(step - step_s) < 1e-3 * step_s or scale in (LIMIT, 1 / LIMIT):
            break
    return scale


def scaled(profile: "StepProfile", scale: float) -> "StepProfile":
    """``profile`` with every compute time multiplied by ``scale`` (each block's, their eager
    figures, the rest's) and ``compute_scale`` recording it; memory figures unchanged."""
    if scale == 1.0:
        return profile
    return dataclasses.replace(profile, blocks=[_block(b, scale) for b in profile.blocks],
                               eager_blocks=[_block(b, scale) for b in profile.eager_blocks],
                               rest_fwd_s=profile.rest_fwd_s * scale, rest_bwd_s=profile.rest_bwd_s * scale,
                               compute_scale=profile.compute_scale * scale, notes=list(profile.notes))


def _block(block: "BlockProfile", scale: float) -> "BlockProfile":
    return dataclasses.replace(block, **{k: getattr(block, k) * scale for k in TIME_FIELDS})
