"""A rehearsal step before training: a plan that overshoots its budget is made again, not run out of memory.

The scheduler's memory model counts tensors; the device's allocator also rounds blocks and keeps
a reserve, and a model can hold memory its profile never saw. So before the first real step an
engine with a scheduled plan and a ``device_budget`` runs one whole step (two micro-batches when
it accumulates) on the planning sample at learning rate 0, with the cap lifted, and measures the
device's peak. AdamW at rate 0 leaves every weight exactly as it was (decay ``1 - 0 * wd`` is 1,
the step ``-0 * m / d`` adds zero), so afterwards only the moments and step counts are put back
to their start. With ``max_grad_norm`` the rehearsal's clip never fires
(``GlobalNormClip.suspended``): its steps are the plain ones the plan's prediction prices. If
the peak is over the budget, the engine takes its (unchanged) weights back from its shadow
model unit by unit as it gives its buffers up, and is built again for the plan the scheduler makes
from the same profile with a margin that covers what the prediction missed (no new profiling),
up to :data:`ATTEMPTS` times. Lifting the cap means the overshoot is measured, never hit: an
out-of-memory error in the middle of a step would leave its tensors to the autograd graph.
Uncapped, though, a caching allocator keeps what it freed, by an amount that varies with
timing; where only that cache was over (the step allocated within the budget), one more step
runs held as training will be (:func:`confirm_under_cap`), and the plan is kept if it fits
there; one that runs out of memory there is made again as above, its rebuild freeing what the
failed step left.

The steps are run and read by ``rehearsal_steps.py``; this module decides what their figures mean.
Where the plan's host rate is to be checked, the rehearsal is :data:`RATE_STEPS` whole steps of
the run's own micro-batch count, and the host updates are timed from the second step's ``step()``
to the third's: the second step's updates that run beside the third step's forward, and the
third's own summing and updates, as a training step mixes them. Neither a lone step nor two
micro-batches of a longer step are that mix: a lone step's updates run after its backward with
nothing beside them (0.211 ns per parameter in the 128-layer rehearsal, against 0.236-0.255 in
the steps, 2026-12-03), and a step of 8 micro-batches ended after 2 sums the pair into the fp32
buffer and then updates from it (0.33-0.40 ns per parameter on the §3 model), where the plan
priced a 2-micro-batch step's update that adds the pair as it reads it (0.25): the plan was
priced with a host 1.58x slower than the one its steps of 8 had, which ran at the plan's own rate
(0.60-0.66 ns per parameter against 0.67; H200, session 20). The plan is then priced again on
the profile calibrated to the measured rates of both (its prediction is the measured host's;
after a rebuild for memory, the least disturbed of the timed rehearsals': ``least_disturbed``;
while the kernel timed alone around the steps ran slower than profiled, they run again, and
still disturbed they count at most at the plan's price times the slowdown the kernel alone
showed on both sides of them, and settled at most at ``host_calibration.CEILING`` times the
price: ``host_calibration.undisturbed``; one still disturbed only bounds an earlier settled one),
and where the host bounds it, on what the clocked steps of the last rehearsal the host settled
through ran beyond their host work (``host_calibration.with_gap``), and where the device's compute
bounds it, on that rehearsal's step (``compute_calibration.py``); where the updates, or the sums of the earlier
micro-batches, ran more than 10 % off what the plan assumed for them, the scheduler also
searches again where the host bounds the plan (``host_calibration.py``), and a faster plan is
built and rehearsed in its turn (real devices only).

Under gradient accumulation a plan is then raced against the scheduler's best plan summing its
micro-batches on the other side (host or device), where the model predicts the two close: both
rehearsed and timed, the faster kept (``sum_placement.py``) and priced on the host work its own
rehearsal measured.

A plan that fits is then held to its prediction: the allocator's cap comes down from the budget
to the predicted peak (:func:`hold_to_plan`; it stays at the budget where the rehearsal allocated
more than predicted), so the reserved bytes of every later step stay within what the plan said
it would take.

A plan given rather than scheduled cannot be made again: one that peaks over the budget is
refused (:class:`PlanOverBudgetError`, naming the peak) before training, not run out of memory in
step 0. Not under data parallelism (the ranks would have to re-plan together): there the plan is
the one scheduled. Without a budget (the whole device) there is nothing to lift, and no rehearsal.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from xpu.units import format_bytes, parse_bytes

from . import gc_pauses
from .compute_dtype import cast_parameters, restore_parameters
from .cost import count_units
from .host_calibration import (Reading, applies, ceiling_note, checked_plan, priced_on_own_rate, ratios, reading,
                               same_layout, settled, step_gap, undisturbed)
from .plan_check import PlanOverBudgetError
from .planning import SETUP_NOTE, replan
from .rehearsal_steps import (CLOCKED_STEPS, GC_PAUSE_S, RATE_STEPS, Clocked, Rehearsed, clock_note, measured_peak,
                              start_peak)
from .rehearsal_steps import rehearse as _rehearse
from .sum_placement import SumPlacement
from .units import split_units

if TYPE_CHECKING:
    from .engine import MemFerry

__all__ = ["fit_by_rehearsal", "give_back", "hold_to_plan", "covering_margin", "PlanOverBudgetError", "ATTEMPTS",
           "MARGIN_STEP", "RATE_STEPS", "CLOCKED_STEPS", "GC_PAUSE_S", "start_peak", "measured_peak", "Clocked",
           "Rehearsed", "clock_note"]


_log = logging.getLogger("xpu.memferry")

#: Plans made again after the first peaks over the budget, each with a larger margin.
ATTEMPTS = 3
#: How much more margin each new attempt takes than the overshoot it measured.
MARGIN_STEP = 0.05


def fit_by_rehearsal(engine: "MemFerry", sample: tuple[Any, Any]) -> None:
    """Rehearse ``engine``'s plan on ``sample``; re-plan with a margin that covers the measured
    overshoot while its peak is over the budget, and once from a profile calibrated to the
    step's host rate where that was off (see the module docstring). On return the engine
    is as if just built, for a plan whose rehearsal fitted; ``engine.plan.notes`` says what was tried.

    Raises:
        PlanOverBudgetError: a given (not scheduled) plan peaked over the budget.
        torch.OutOfMemoryError: every attempt peaked over the budget (the message says by how much),
            or the rehearsal ran out of the device's whole memory.
        NoPlanFitsError: the scheduler found no plan for the larger margin.
    """
    setup = engine._setup
    if setup["device_budget"] is None:
        return
    budget = parse_bytes(setup["device_budget"])
    margin = setup["memory_margin"]
    tried: list[str] = []
    calibration: list[str] = []  # what the host-rate check found (host_calibration.py)
    rehearsed_s = None  # the timed rehearsal's last step, where its layout is the one kept
    rate_checked = engine.plan.profile is None or not applies(engine.backend)  # a given plan has no profile
    backend, device = engine.backend, engine.device
    started = time.perf_counter()
    setup_notes = [n for n in engine.plan.notes if n.startswith(SETUP_NOTE)]  # a plan made again has its own notes
    placement = SumPlacement(setup.get("sum_placement", "race") == "race")  # where sums go, raced on the wall clock
    race_next = False  # a calibrated plan of another layout: its rehearsal is timed, and raced
    clocks: list[str] = []  # each timed rehearsal's steps, one by one (clock_note)
    rates: list[Reading] = []  # each timed rehearsal's host ratios to its plan, until the check
    gap = None  # what a step ran beyond its host work (with_gap), in the last rehearsal the host settled through
    while True:
        backend.set_memory_cap(device, None)  # measure the overshoot rather than run into it
        try:
            timed = not rate_checked or placement.timing or race_next
            rehearsed = _rehearse(engine, sample, timed)
        finally:
            backend.set_memory_cap(device, budget)
        peak, allocated, host, send_s, clock, alone, by_stream = rehearsed
        step_s = rehearsed.step_s
        if clock:
            read = ratios(engine.plan, host) if host and engine.plan.host_s_per_param else None
            clocks.append(clock_note(len(clocks) + 1, clock, alone, read))
        pair = alone[-1] if alone else None  # the kernel alone around the last run of the steps
        taken = undisturbed(host, pair, engine.plan)
        held_down = ceiling_note(engine.plan, host, taken, pair)
        if held_down and not rate_checked:
            calibration.append(held_down)
        found = reading(engine.plan, host, taken, pair)
        if found and not rate_checked:
            rates.append(found)
        host = taken
        calm = settled(pair)  # nothing else had the host
        if calm:
            gap = step_gap(clock)
        predicted = engine.plan.predicted_peak_bytes or 0
        capped = ""  # where the cache alone was over: what one step under the plan's hold showed
        if peak > budget >= allocated + backend.cap_overshoot(device):
            confirmed = confirm_under_cap(engine, sample, budget, predicted, rehearsed)
            if confirmed is not None:
                peak, capped = confirmed
        if peak <= budget:
            if not rate_checked:
                rate_checked = True
                if step_s is not None and engine.plan.predicted_step_s:
                    calibration.append(_step_note(step_s, engine.plan.predicted_step_s))
                again = checked_plan(engine, budget, margin, calibration, host, send_s, rates, gap,
                                     step_s if calm else None)
                if again is not None and not same_layout(again, engine.plan):
                    if placement.may_race(engine):
                        placement.replaced(engine.plan, step_s)
                    _rebuild(engine, again)  # its memory is rehearsed again; its host rate is not
                    race_next = placement.may_race(engine)  # timed then, where its sums can be placed
                    continue
                if again is not None:
                    engine.plan = again
                rehearsed_s = step_s  # of the layout kept
                other = placement.alternative(engine, step_s, budget, margin)
                if other is not None:
                    _rebuild(engine, other)  # rehearsed next, timed
                    continue
            elif race_next:
                race_next = False
                rehearsed_s = step_s
                other = placement.after_replacement(engine, step_s, budget, margin)
                if other is not None:
                    _rebuild(engine, other)  # a rival (timed next), or the replaced plan back (untimed)
                    if not placement.timing:
                        rehearsed_s = placement.original_s
                    continue
                priced_on_own_rate(engine, host, margin, placement.notes, gap)
            elif placement.timing:
                back = placement.settle(step_s)
                rehearsed_s = step_s
                if back is not None:
                    _rebuild(engine, back)  # its memory is rehearsed again, untimed
                    rehearsed_s = placement.original_s
                    continue
                priced_on_own_rate(engine, host, margin, placement.notes, gap)
            held = hold_to_plan(engine, budget, predicted, allocated)
            n = engine.micro.steps
            what = f"{RATE_STEPS} steps of {n} micro-batch{'es' if n > 1 else ''}" if timed else "one step"
            note = (f"rehearsal: {what} at learning rate 0 peaked at "
                    f"{format_bytes(peak)} reserved, {format_bytes(allocated)} allocated, budget "
                    f"{format_bytes(budget)}, predicted {format_bytes(predicted)}"
                    + (f" (after {'; '.join(tried)})" if tried else "")
                    + (f"; reserved by stream: {by_stream}" if by_stream else "")
                    + (f"; {capped}" if capped else "")
                    + f"; the allocator is held to {format_bytes(held)}"
                    + f"; rehearsing took {time.perf_counter() - started:.1f} s")
            kept = [n for n in setup_notes if n not in engine.plan.notes]
            engine.plan = dataclasses.replace(engine.plan, notes=[*engine.plan.notes, *kept, *calibration,
                                                                  *placement.notes, *clocks, note],
                                              rehearsed_step_s=rehearsed_s)  # the caller's plan stays as given
            engine.executor.plan = engine.plan
            setup["memory_margin"] = margin  # later re-plans (out of memory, longer batches) start from it
            _reset(engine)
            # What the uncapped rehearsal left cached would stay reserved over the cap: plans held
            # to 10.6 GB kept the 11.0-11.1 GB reserved through every step (H100, 2026-12-05).
            backend.release_cache(device)
            return
        if placement.timing:  # the device-summing plan does not fit: back to the one that did
            _rebuild(engine, placement.overshot(format_bytes(peak)))
            rehearsed_s = placement.original_s
            continue
        if engine.plan.profile is None:  # given, not scheduled: nothing to make again
            raise PlanOverBudgetError(
                f"the given plan peaks at {format_bytes(peak)} in one step (measured at learning rate 0 before "
                f"training), over device_budget {format_bytes(budget)}; use plan='auto' (the scheduler fits the "
                f"budget), a plan with +recompute or fewer resident blocks, or a device_budget of at least "
                f"{format_bytes(peak)}", minimum=peak)
        tried.append(f"margin {margin:.0%} peaked at {format_bytes(peak)} ({format_bytes(allocated)} allocated"
                     + (f"; by stream: {by_stream})" if by_stream else ")"))
        if len(tried) > ATTEMPTS or not predicted:
            raise torch.OutOfMemoryError(
                f"MemFerry: every plan the scheduler made peaked over device_budget {format_bytes(budget)} in its "
                f"rehearsal step ({'; '.join(tried)}); give a larger device_budget or memory_margin, or a smaller batch")
        margin = covering_margin(peak, predicted, margin)
        # What overshot, so a later reading of the log can tell which term the memory model missed.
        _log.warning("MemFerry: the plan peaked at %s in its rehearsal step (%s allocated; predicted %s%s), over "
                     "the %s budget (its blocks: %s; prefetch depth %d, rest optimizer on the %s); planning again "
                     "with memory margin %.0f%%", format_bytes(peak), format_bytes(allocated), format_bytes(predicted),
                     f"; reserved by stream: {by_stream}" if by_stream else "",
                     format_bytes(budget), count_units(engine.plan.units), engine.plan.prefetch_depth,
                     engine.plan.rest_optimizer, margin * 100)
        plan = replan(engine.plan, budget, backend, device, margin)
        _rebuild(engine, plan)


def confirm_under_cap(engine: "MemFerry", sample: tuple[Any, Any], budget: int, predicted: int,
                      uncapped: Rehearsed) -> tuple[int, str] | None:
    """Run one more rehearsal step with the allocator held as training would hold it
    (:func:`hold_to_plan`), where the ``uncapped`` rehearsal reserved more than ``budget`` but
    allocated less. Returns the step's peak and what it showed (one line for the plan's note)
    where it ran within the hold; None where it ran out of memory there (the cap is back at
    ``budget``; the caller makes the plan again, and its rebuild frees what the failed step
    left).

    Uncapped, a caching allocator keeps every block it freed, and how much depends on timing:
    one layout of the 128-layer model under 16 GB allocated 15.0-15.1 GB and reserved 15.3-15.6
    in nine runs, and 16.7 in another (H100 and H200, sessions 36-47), which was planned and
    rehearsed again like seven more first plans over 16 GB; each rebuild also disturbed the host
    the next rehearsal priced. Held at a cap, the allocator gives its cache back before it
    fails (each time a retry: it waits for every stream's pending frees), so the steps need
    what they allocate, not what the uncapped cache kept."""
    backend, device = engine.backend, engine.device
    held = hold_to_plan(engine, budget, predicted, uncapped.allocated)
    retries = backend.memory_stats(device).alloc_retries
    try:
        got = _rehearse(engine, sample)
    except torch.OutOfMemoryError as exc:
        said = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "out of memory"
        _log.warning("MemFerry: the plan reserved %s uncapped and allocated %s; held to %s it ran out of memory "
                     "(%s)", format_bytes(uncapped.peak), format_bytes(uncapped.allocated), format_bytes(held), said)
        backend.set_memory_cap(device, budget)
        return None
    retries = backend.memory_stats(device).alloc_retries - retries
    return got.peak, (f"uncapped it reserved {format_bytes(uncapped.peak)}, cache beyond its "
                      f"{format_bytes(uncapped.allocated)} allocated; one step held to {format_bytes(held)} "
                      f"reserved {format_bytes(got.peak)} ({format_bytes(got.allocated)} allocated, {retries} "
                      f"allocator retr{'y' if retries == 1 else 'ies'})")


def covering_margin(peak: int, predicted: int, margin: float) -> float:
    """The memory margin that would have covered ``peak`` where a plan planned with ``margin``
    predicted ``predicted`` (= raw x (1 + margin)), and a step more; at least a step above ``margin``."""
    return max(margin + MARGIN_STEP, peak / (predicted / (1 + margin)) - 1 + MARGIN_STEP)


def _step_note(measured: float, predicted: float) -> str:
    """The rehearsal's last steps against the plan's prediction (before any calibration): a
    host-bound plan's miss shows here before training, whichever term the model got wrong."""
    return (f"rehearsal step: the last {CLOCKED_STEPS} took {measured * 1e3:.1f} ms each on average against the "
            f"{predicted * 1e3:.1f} ms predicted ({(predicted - measured) / measured:+.1%})")


def hold_to_plan(engine: "MemFerry", budget: int, predicted: int, allocated: int) -> int:
    """Cap the device's allocator at the plan's predicted peak, less what the allocator may pass
    a cap by (``Backend.cap_overshoot``: CUDA's expandable-segment page), or at ``budget`` where
    the rehearsal's ``allocated`` peak was higher than that (the memory model missed: no
    prediction to hold to), and return the cap.

    A caching allocator keeps freed blocks reserved until it meets its cap: left at the
    budget, a plan predicted at 7.94 GB of an 8 GB budget reserved 7.99 GB in its steps
    (7.40 GB allocated). Held to its own prediction, the engine's reserved peak stays within
    what it said it would take, and the budget's rest is the caller's; the allocator frees its
    cache before it would go over. The rehearsal's allocated peak shows the step needs no more
    than the cap. Its reserved peak, taken uncapped, is no such measure: it holds whatever the
    cache kept (a Qwen2-1.5B plan predicted at 7.84 GB reserved 7.9 uncapped, its steps
    allocating at most 7.30, and, held there, reserved 7.94 GB in its steps: over its
    prediction; H200, 2026-12-03). Nor is the allocated peak a cap to hold a plan the model
    missed to: a caller's loop may hold a little more than the rehearsal did (held there, a
    tiny plan ran out of memory by the 4 bytes of a loss kept through backward)."""
    # The allocator may pass its cap by a page (``Backend.cap_overshoot``): held that much lower, its
    # reserved peak stays at the prediction, where the step's allocated peak leaves that room.
    slack = engine.backend.cap_overshoot(engine.device)
    held = (budget if allocated > predicted - slack else min(budget, predicted) - slack) if predicted else budget
    engine.backend.set_memory_cap(engine.device, held)
    return held


def _reset(engine: "MemFerry") -> None:
    """Moments and step counts back to the start, counters to zero: the engine as just built."""
    for s in engine.shadow.shadows:
        s.exp_avg.zero_()
        s.exp_avg_sq.zero_()
        s.step = 0
    engine.optimizer.reset_counters()
    engine.optimizer.sync_steps_from_shadows()
    engine.device_optimizer.sync_steps_from_shadows(engine.shadow.shadows)
    engine.executor.invalidate_device_copies()
    engine.executor.post.reset_counters()
    engine._steps = 0
    if engine.clip is not None:
        engine.clip.reset()


def give_back(engine: "MemFerry", keep_optimizer: bool = False) -> dict[str, Any] | None:
    """Release ``engine``'s parts and point the model's parameters at ordinary host tensors of
    its weights, as ``engine.shadow.state_dict()`` has them (after a rehearsal, those it was
    built from: rehearsals run at rate 0). They are taken unit by unit as the shadow's buffers
    are freed (``ShadowModel.release``): the host holds one unit's copy beside the shadow, not
    the whole model's. ``keep_optimizer``: the optimizer state is taken out that way too and
    returned (``optimizer_state_dict``'s form); else None."""
    gc_pauses.release(engine)  # the parts' cycles collectable again: the collection below frees them
    engine.optimizer.close()  # the worker first: nothing may write the masters while they are read
    engine.executor.close()
    if engine.copier is not None:
        engine.copier.close()
    shadow = engine.shadow
    # Only the shadow may hold its buffers while it frees them unit by unit, its state taken out.
    del engine.shadow, engine.optimizer, engine.device_optimizer, engine.executor
    gc.collect()
    state = shadow.release(keep_weights=True, keep_optimizer=keep_optimizer)  # fp32 originals where cast
    del shadow
    restore_parameters(engine.model, state["model"])
    return state.get("optimizer")


def _rebuild(engine: "MemFerry", plan: Any, keep_optimizer: bool = False) -> None:
    """Build ``engine``'s parts again for ``plan`` from its weights (see :func:`give_back`);
    ``keep_optimizer``: its masters, moments and step counts too, each unit's put back as the
    unit is made (``ShadowModel(kept=...)``)."""
    kept = give_back(engine, keep_optimizer)
    model, setup = engine.model, engine._setup
    originals = cast_parameters(model, setup["compute_dtype"])
    engine._assemble(split_units(model, setup["blocks"], setup["no_decay"]), plan, originals, kept)
