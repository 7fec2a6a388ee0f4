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

Something else can have the host while a rehearsal runs. The 128-layer GPT's rehearsals ran
their updates 1.28-1.47x their price and its steps a minute later 1.03-1.10x, with a million
interrupts a second and 7 % system time through the rehearsal against ten thousand and 0-1 %
through the steps (H100, bench/results/2026-12-06-h100-session36/: right after 96 GB of host
memory was pinned). So the kernel is also timed alone, on the profiler's buffers, just before
and after the rehearsal's steps (:func:`alone_slowdown`). Where it ran more than
:data:`DISTURBED` slower than profiled, the steps run again, up to :data:`SETTLE_TRIES` times;
a rehearsal still disturbed then counts at most at the plan's price times the slowdown the kernel
alone showed on both sides of its steps (a disturbance only slows the host: :func:`undisturbed`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, NamedTuple, Sequence

from .adamw_rates import host_adamw_rate
from .compute_calibration import compute_scale, scaled
from .config import Plan
from .cost import predict
from .links import links_from_probe
from .planning import replan

if TYPE_CHECKING:
    from xpu import Backend

    from .engine import MemFerry
    from .links import Links
    from .profiler import StepProfile
    from .rehearsal import Clocked

__all__ = ["TOLERANCE", "SEARCH_AGAIN", "DISTURBED", "SETTLE_TRIES", "CEILING", "Reading", "applies", "ratios",
           "reading", "least_disturbed", "alone_slowdown", "settled", "undisturbed", "ceiling_note", "calibrated",
           "with_sends", "step_gap", "with_gap", "repriced", "same_layout", "checked_plan", "priced_on_own_rate"]

_log = logging.getLogger("xpu.memferry")

#: Measured over planned host rate beyond which the scheduler may search again (either way).
TOLERANCE = 1.10
#: Relative change of a predicted step worth a new search, and a new plan's least gain over the old.
SEARCH_AGAIN = 0.02
#: The host kernel alone, timed around a rehearsal, over its profiled rate beyond which the
#: rehearsal's host counts as disturbed (two timings of one buffer differ by a few percent: 1.05x
#: beside a rehearsal the steps then matched, H100, session 36).
DISTURBED = 1.08
#: Times a rehearsal's steps run again while the host kernel alone ran slower than
#: :data:`DISTURBED` around them (:func:`settled`).
SETTLE_TRIES = 2
#: The most over their price a settled rehearsal's host updates are believed, in a plan with no
#: gradient accumulation (:func:`undisturbed`). Over the 41 host-bound rows without it of sessions
#: 34-44 (H100 and H200 hosts, 24-128 layers) the timed steps' updates never ran more than 1.24x
#: their price, while four settled rehearsals read 1.28-1.51x (their steps 1.12-1.24x), three of
#: them putting the prediction 15-25 % long; taken at this ceiling, all four come within 5 %
#: (bench/results/2026-12-06-h100-session44/ceiling_replay.py). With accumulation (sums beside the
#: updates) the steps' updates ran up to 1.25x and the rehearsal's rate held the predictions
#: within 10 % in 22 of 23 rows: no ceiling there. A host whose steps truly run slower than
#: this, with the kernel alone at its profiled rate, would be predicted short.
CEILING = 1.25


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


class Reading(NamedTuple):
    """One timed rehearsal's host work over the price of the plan it ran (:func:`ratios`: updates,
    earlier sums): ``taken`` as :func:`undisturbed` took it, ``measured`` as its steps ran it, and
    ``settled``: whether the host kernel alone ran at its profiled rate around them (or was not
    timed alone)."""

    taken: tuple[float, float]
    measured: tuple[float, float]
    settled: bool


def reading(plan: Plan, measured: tuple[float, float] | None, taken: tuple[float, float] | None,
            pair: tuple[float, float] | None) -> Reading | None:
    """The :class:`Reading` of a rehearsal of ``plan`` whose host work was ``measured``, taken as
    ``taken`` (:func:`undisturbed`), the kernel alone ``pair`` around its steps; None where
    nothing was taken or the plan updates nothing on the host."""
    if not measured or not taken or not plan.host_s_per_param:
        return None
    return Reading(ratios(plan, taken), ratios(plan, measured), settled(pair))


def least_disturbed(found: Sequence[Reading]) -> tuple[float, float]:
    """The host's ratios to its price over the timed rehearsals of one fit (:class:`Reading`, each
    against the plan it rehearsed): the least of each part over the settled ones, where any settled,
    and at most what a disturbed one measured; else the least each took.

    The least, as a disturbance only slows the host, and rebuilding the engine for a plan that
    peaked over the budget disturbs it: it frees the old shadow's pinned buffers and pins the new
    one's. The 128-layer GPT's host updates ran 1.00x their price in its first rehearsal, 1.22x in
    the one after such a rebuild, and 1.04x in its steps (H100,
    bench/results/2026-12-05-h100-session35/call2/s128). But a disturbed rehearsal's taken figure is
    a bound (the price times the kernel's slowdown alone), not a reading, and may be under a settled
    reading: the same model's first rehearsal ran its updates about 1.17x their price with the host
    settled, the one after the rebuild stayed disturbed (the kernel alone 1.00x before, 1.15x after)
    and was taken at 1.00x, the least, and the steps ran 1.24x: predicted 21 % short (H200,
    bench/results/2026-12-06-h200-session46/call4/s128)."""
    exact = [r.taken for r in found if r.settled]
    bounds = exact + [r.measured for r in found if not r.settled] if exact else [r.taken for r in found]
    return min(b[0] for b in bounds), min(b[1] for b in bounds)


def alone_slowdown(engine: "MemFerry") -> float | None:
    """The host kernel's seconds per parameter alone now, on buffers as long as the profiler's,
    over the profile's figure (:func:`settled` judges a rehearsal's host by it).
    None where the check does not apply (:func:`applies`), the profile did not record its
    buffers' length, or the host arena has no room for them."""
    profile = engine.plan.profile
    numel = profile.host_adamw_numel if profile is not None else 0
    if not applies(engine.backend) or not numel or not profile.host_adamw_s_per_param or not engine.shadow.shadows:
        return None
    dtype = engine.shadow.shadows[0].work.dtype
    try:
        now = host_adamw_rate(numel, dtype, 3, engine.backend, engine.cfg.host_kernel, engine.device)
    except (MemoryError, OSError, RuntimeError):  # no room for the buffers (budget, mapping, pinning)
        return None
    return now / profile.host_adamw_s_per_param


def settled(pair: tuple[float, float] | None) -> bool:
    """Whether the host kernel ran within :data:`DISTURBED` of its profiled rate both before and
    after a rehearsal's steps (``pair``): nothing else had the host meanwhile. None (not timed
    alone: a virtual device, or a profile without the kernel's figures) counts as settled: nothing
    says otherwise, and the rehearsal's figures are taken as measured."""
    return pair is None or max(pair) <= DISTURBED


def undisturbed(measured: tuple[float, float] | None, pair: tuple[float, float] | None,
                plan: Plan | None = None) -> tuple[float, float] | None:
    """A rehearsal's host work ``measured`` (update, earlier sums: seconds per parameter) where
    the host kernel ran :func:`settled` alone around its steps (``pair``: :func:`alone_slowdown`
    before and after them; None: not timed). Where the host stayed disturbed, the figures say
    nothing exact about the steps: divided by the kernel's slowdown alone they would not do (the
    128-layer GPT's rehearsal ran its updates 1.47x their price with the kernel alone 1.13x slower
    than profiled, and its steps 1.10x: H100, bench/results/2026-12-06-h100-session36/call3/s128).
    But a disturbance only slows the host, so each part still bounds its own rate from above,
    and the kernel alone bounds it from below where it ran slower on both sides of the steps: the
    host was that much slower than profiled all along, not only disturbed (an H200's 128-layer
    rehearsal ran its updates 1.27x their price, the kernel alone 1.08-1.13x around every run of
    its steps, and its steps 1.19x; kept at the price, the step was predicted 17 % short:
    bench/results/2026-12-06-h200-session39/call2/s128). So with ``plan``, each part is taken at
    most at its price times that level (the smaller of ``pair``, at least 1): a part measured
    under that is taken as measured (the HF model's sums, priced 1.5x what they ran in the
    rehearsals that settled: H100, bench/results/2026-12-06-h100-session37/call3/hf16). None
    where every part stays at its price (no part came in under it and the kernel alone was not
    slower on both sides), or without ``plan``: the plan keeps its rate. Where the host settled
    and ``plan`` prices no sums of earlier micro-batches, the host work is taken at most at
    :data:`CEILING` times its price."""
    if measured is None or pair is None:
        return measured
    if settled(pair):
        return _within_ceiling(measured, plan)
    if plan is None or not plan.host_update_s_per_param:
        return None
    level = max(1.0, min(pair))
    price_update, price_earlier = plan.host_update_s_per_param, plan.host_earlier_s_per_param or 0.0
    if price_earlier <= 0:  # priced as updates alone: ratios() counts the sums with them
        measured, price_earlier = (sum(measured), 0.0), 0.0
    taken = (min(measured[0], price_update * level), min(measured[1], price_earlier * level))
    if level == 1.0 and min(ratios(plan, measured)) >= 1.0:
        return None
    return taken


def _within_ceiling(measured: tuple[float, float], plan: Plan | None) -> tuple[float, float]:
    """``measured`` (its two parts together, as :func:`ratios` counts them where the plan prices no
    sums apart) at most :data:`CEILING` times its price in ``plan``; as it was where the plan
    prices sums of earlier micro-batches (accumulation)."""
    if plan is None or not plan.host_update_s_per_param or (plan.host_earlier_s_per_param or 0.0) > 0:
        return measured
    most = plan.host_update_s_per_param * CEILING
    return measured if sum(measured) <= most else (most, 0.0)


def ceiling_note(plan: Plan, measured: tuple[float, float] | None, taken: tuple[float, float] | None,
                 pair: tuple[float, float] | None) -> str | None:
    """What :func:`undisturbed` did to a settled rehearsal's host work ``measured`` (``taken``:
    what it gave), where it held the updates to :data:`CEILING`; None elsewhere."""
    if measured is None or taken is None or pair is None or not settled(pair) or taken == measured:
        return None
    return (f"host ceiling: the rehearsal's updates read {ratios(plan, measured)[0]:.2f}x their price with the "
            f"kernel alone settled around them; taken at {CEILING:.2f}x, the most timed steps have run over it")


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


def step_gap(clock: Sequence["Clocked"]) -> float | None:
    """The least, over a rehearsal's clocked steps (``step_s``, ``host_s``), of a step's wall time
    beyond the host optimizer's work in it; None without clocked steps. The least, as a
    disturbance only adds to it."""
    return min((c.step_s - c.host_s for c in clock), default=None)


def with_gap(plan: Plan, profile: "StepProfile", links: "Links", margin: float,
             gap_s: float) -> "StepProfile":
    """``profile`` with ``host_gap_s`` set so that ``plan``, priced on it, runs ``gap_s`` (a
    rehearsal's :func:`step_gap`) beyond its host work, where the host bounds it (its work and
    waits, or its memory's bandwidth: the cost model adds ``host_gap_s`` to both terms); as it
    was elsewhere (the step is not the host's work and a wait there). Never below what the model
    prices (``host_gap_s`` at least 0).

    Why: the cost model prices a host-bound step as its host work and one wait (from the last
    update the next forward needs to the first gradient of its backward: 15-26 ms at 64-128
    layers), and such steps ran 20 ms and about 0.6 ms a layer more in every host-bound row of
    sessions 33-42 (48 and 91 ms at 64 and 128 layers on the H200 in session 42), the host
    worker idle part of it and the rest between its timed pieces (at 128 layers on an H100 in
    session 43: 46 ms of its 88 idle or waiting for a gradient, 42 in neither). What a rehearsal's
    steps ran beyond their host work was within 15 ms of what the training steps did in 29 of the
    35 host-bound rows of sessions 34-43; four of the six others rehearsed through storms of TLB
    shootdowns (sessions 35-38, 85-115 ms more). Priced so, those rows' predictions would have
    been within 10 % in 27 of 35 (26 as logged), mean |error| 7.2 % (8.0): host rates that drift
    between rehearsal and steps are the rest (bench/results/2026-12-06-h100-session43/)."""
    pred = predict(plan, profile, links, margin)
    if pred.bound not in ("host optimizer", "host memory"):
        return profile
    priced = pred.step_s - pred.host_optimizer_s
    extra = max(0.0, profile.host_gap_s + gap_s - priced)
    if abs(extra - profile.host_gap_s) < 1e-9:  # already priced (to a nanosecond)
        return profile
    note = (f"a host-bound step runs {gap_s * 1e3:.1f} ms beyond its host work (rehearsed), "
            f"{priced * 1e3:.1f} priced: {extra * 1e3:.1f} ms added to the host's term")
    return dataclasses.replace(profile, host_gap_s=extra, notes=[*profile.notes, note])


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


def checked_plan(engine: "MemFerry", budget: int, margin: float, found: list[str],
                 measured: tuple[float, float] | None, send_s: float | None = None,
                 rates: Sequence[Reading] = (), gap_s: float | None = None,
                 step_s: float | None = None) -> Plan | None:
    """The plan priced again on a profile calibrated to the rehearsal's host work ``measured``
    (seconds per parameter: the updates, the earlier micro-batches' sums; None: not taken), or to
    :func:`least_disturbed` of ``rates`` (every timed rehearsal's, this one's last), to the issuing
    thread's ``send_s`` (seconds per send before a step's last micro-batch:
    ``StepProfile.earlier_send_s``) where it was measured, and to ``gap_s`` (a host-bound step's
    time beyond its host work, :func:`with_gap`) where it was, and to ``step_s`` (the rehearsal's
    step, timed with the host undisturbed) where the device's compute bounds the plan
    (``compute_calibration.py``); searched again where the host bounds it and either part was off
    the plan's by more than ``TOLERANCE`` (or sends were measured, or the gap or the compute was
    priced anew). None where nothing was measured. What it found is appended to ``found``."""
    plan = engine.plan
    links = links_from_probe(engine.backend, engine.device)
    planned = plan.host_s_per_param  # the rehearsal's steps are whole ones: the plan's own rate
    if not planned or not (measured or rates):
        return None
    if measured:
        update, earlier = ratios(plan, measured)
        said = (f"host rate: the rehearsal's host work ran at {sum(measured) * 1e9:.3f} ns/param, "
                f"{sum(measured) / planned:.2f}x the {planned * 1e9:.3f} the plan assumed (updates {update:.2f}x, "
                f"earlier micro-batches' sums {earlier:.2f}x)")
    else:
        said = (f"host rate: the last rehearsal's host stayed disturbed, the plan's {planned * 1e9:.3f} ns/param "
                f"kept for it")
    least = least_disturbed(rates) if rates else None
    if least is not None and (not measured or len(rates) > 1 and least != (update, earlier)):
        update, earlier = least
        said += (f"; over {len(rates)} timed rehearsals (a rebuild's freeing and pinning slows the host for a while; "
                 f"one the host stayed disturbed through only bounds those it settled through): updates "
                 f"{update:.2f}x, sums {earlier:.2f}x")
    rates_off = not all(1 / TOLERANCE <= r <= TOLERANCE for r in (update, earlier))
    # Within the tolerance the layout stays (no search), but its prediction is made on the
    # measured rates: a host-bound plan 8 % slower than priced had been predicted 13-16 % short
    # (64 layers under 16 GB, H200, 2026-12-04).
    profile = calibrated(plan.profile, update, earlier)
    if send_s:
        profile = with_sends(profile, send_s)
        said += (f"{'' if rates_off else ' (within the tolerance)'}; sends before a step's last micro-batch took "
                 f"{send_s * 1e3:.2f} ms each on the issuing thread")
    gapped = with_gap(plan, profile, links, margin, gap_s) if gap_s is not None else profile
    priced_anew = gapped is not profile  # the gap or the compute: searched again where the step moved
    if priced_anew:
        profile = gapped
        said += f"; {profile.notes[-1]}"
    scale = compute_scale(plan, profile, links, margin, step_s)
    if scale is not None:
        profile = scaled(profile, scale)
        said += (f"; the device's compute bounds the plan and its rehearsed step took {step_s * 1e3:.1f} ms: "
                 f"the profile's compute times scaled {scale:.3f}x")
        priced_anew = True
    kept = repriced(plan, profile, links, margin)
    before, now = plan.predicted_step_s or 0.0, kept.predicted_step_s or 0.0
    unmoved = f"its step moved under {SEARCH_AGAIN:.0%}" if priced_anew else "the host does not bound it"
    again, how = kept, f"{unmoved}: same plan, not searched again"
    if not rates_off and not send_s and not priced_anew:
        how = "within the tolerance: same plan, not searched again"
    elif abs(now - before) > SEARCH_AGAIN * before:
        searched = replan(plan, budget, engine.backend, engine.device, margin, profile=profile)
        better = (searched.predicted_step_s or now) < now * (1 - SEARCH_AGAIN)
        again, how = (searched, "searched again: a faster plan") if better else (kept, "searched again: same plan kept")
    found.append(f"{said}; the profile's host work scaled to it: predicted step {before * 1e3:.1f} -> "
                 f"{(again.predicted_step_s or 0.0) * 1e3:.1f} ms ({how})")
    _log.info("MemFerry: %s", found[-1])
    return again


def priced_on_own_rate(engine: "MemFerry", measured: tuple[float, float] | None, margin: float,
                       found: list[str], gap_s: float | None = None) -> None:
    """A plan kept after its own timed rehearsal (a race's winner, or a re-searched plan of
    another layout) priced on the host work ``measured`` there, and on the gap ``gap_s`` its
    steps ran beyond it (:func:`with_gap`, None: not measured): its layout was priced on what the
    first plan's rehearsal measured, and a device-summing plan's updates read one fp32 sum where a
    host-summing one's add the step's last micro-batches (the HF model's device-summing winner ran
    10.5 % under its prediction; H200, session 26). Same layout, no search; what it found is
    appended to ``found``."""
    plan = engine.plan
    if not measured or not plan.host_s_per_param or plan.profile is None:
        return
    update, earlier = ratios(plan, measured)
    links = links_from_probe(engine.backend, engine.device)
    profile = calibrated(plan.profile, update, earlier)
    gapped = with_gap(plan, profile, links, margin, gap_s) if gap_s is not None else profile
    kept = repriced(plan, gapped, links, margin)
    found.append(f"sum placement: the kept plan's host work in its own rehearsal ran {update:.2f}x its updates' price "
                 f"and {earlier:.2f}x its sums'"
                 + (f"; {gapped.notes[-1]}" if gapped is not profile else "")
                 + f": predicted step {(plan.predicted_step_s or 0.0) * 1e3:.1f} -> "
                 f"{(kept.predicted_step_s or 0.0) * 1e3:.1f} ms")
    engine.plan = kept
