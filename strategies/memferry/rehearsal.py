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
through ran beyond their host work (``host_calibration.with_gap``); where the updates, or the sums of the earlier
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

import contextlib
import dataclasses
import gc
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from xpu.gc_clock import FullCollections
from xpu.units import format_bytes, parse_bytes

from . import gc_pauses
from .compute_dtype import cast_parameters, restore_parameters
from .host_calibration import (SETTLE_TRIES, Reading, alone_slowdown, applies, ceiling_note, checked_plan,
                               priced_on_own_rate, ratios, reading, same_layout, settled, step_gap, undisturbed)
from .plan_check import PlanOverBudgetError
from .planning import SETUP_NOTE, replan
from .sum_placement import SumPlacement
from .units import split_units

if TYPE_CHECKING:
    from .engine import MemFerry

__all__ = ["fit_by_rehearsal", "give_back", "hold_to_plan", "covering_margin", "PlanOverBudgetError", "ATTEMPTS",
           "MARGIN_STEP", "RATE_STEPS", "CLOCKED_STEPS", "GC_PAUSE_S", "start_peak", "measured_peak", "Clocked", "clock_note"]


_log = logging.getLogger("xpu.memferry")

#: Plans made again after the first peaks over the budget, each with a larger margin.
ATTEMPTS = 3
#: How much more margin each new attempt takes than the overshoot it measured.
MARGIN_STEP = 0.05
#: Whole steps of a rehearsal that checks the host rate; the last one's updates are timed.
RATE_STEPS = 3
#: Of those, the last steps timed on the wall clock, one by one (their mean is the rehearsed
#: step): one alone varied by 1-2 % on the H200, the size of the gaps ``sum_placement.py`` judges.
CLOCKED_STEPS = 2
#: Full garbage collections in a clocked step worth a word in its note (a walk of only what
#: steps made, with the set-up frozen, takes about 1 ms: ``gc_pauses.py``).
GC_PAUSE_S = 0.010


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
        peak, allocated, host, send_s, clock, alone = rehearsed
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
        if pair is None or settled(pair):  # nothing else had the host
            gap = step_gap(clock)
        predicted = engine.plan.predicted_peak_bytes or 0
        if peak <= budget:
            if not rate_checked:
                rate_checked = True
                if step_s is not None and engine.plan.predicted_step_s:
                    calibration.append(_step_note(step_s, engine.plan.predicted_step_s))
                again = checked_plan(engine, budget, margin, calibration, host, send_s, rates, gap)
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
        tried.append(f"margin {margin:.0%} peaked at {format_bytes(peak)}")
        if len(tried) > ATTEMPTS or not predicted:
            raise torch.OutOfMemoryError(
                f"MemFerry: every plan the scheduler made peaked over device_budget {format_bytes(budget)} in its "
                f"rehearsal step ({'; '.join(tried)}); give a larger device_budget or memory_margin, or a smaller batch")
        margin = covering_margin(peak, predicted, margin)
        _log.warning("MemFerry: the plan peaked at %s in its rehearsal step, over the %s budget; planning again "
                     "with memory margin %.0f%%", format_bytes(peak), format_bytes(budget), margin * 100)
        plan = replan(engine.plan, budget, backend, device, margin)
        _rebuild(engine, plan)


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


class Rehearsed(NamedTuple):
    """What :func:`_rehearse` measured.

    Attributes:
        peak: the device's peak over the steps (allocated, or reserved where the allocator
            reserves more: a cap binds on what it reserves).
        allocated: its allocated peak.
        host: timed only: the host's work per parameter as (updates, earlier micro-batches'
            sums) (``HostOptimizer.split_since``); None untimed, or where no update finished.
        send_s: timed only: the issuing thread's mean seconds per gradient send in the clocked
            steps' micro-batches before their last (``GradientPost.earlier_seconds``); None where
            none sent.
        clock: timed only: each of the last :data:`CLOCKED_STEPS` steps' :class:`Clocked`
            figures, in order; else empty.
        alone: timed, where the host rate is checked: the host kernel alone just before and
            after the steps over its profiled rate (``host_calibration.alone_slowdown``), one
            pair per time the steps ran (again while not ``settled``); empty where not measured.
    """

    peak: int
    allocated: int
    host: tuple[float, float] | None = None
    send_s: float | None = None
    clock: tuple["Clocked", ...] = ()
    alone: tuple[tuple[float, float], ...] = ()

    @property
    def step_s(self) -> float | None:
        """Timed only: the clocked steps' mean wall time, the device synchronised around each as
        the benchmark times steps (the previous step's host work running beside it); else None."""
        return sum(c.step_s for c in self.clock) / len(self.clock) if self.clock else None


class Clocked(NamedTuple):
    """One clocked rehearsal step, in seconds: its wall time, the training thread's waits for the
    host optimizer in it (an update to be published, a landing zone to be read), the host
    optimizer's work done in it, and Python's full garbage collections in it (every thread
    stalled: ``xpu/gc_clock.py``). A step slower than predicted whose waits grew was held by the
    host; one whose waits did not was slowed on the training thread or the device."""

    step_s: float
    waited_s: float
    host_s: float
    gc_s: float = 0.0


def clock_note(k: int, clock: tuple[Clocked, ...], alone: Sequence[tuple[float, float]] = (),
               read: tuple[float, float] | None = None) -> str:
    """The ``k``-th timed rehearsal's clocked steps, one by one, for the plan's notes, how the host
    kernel ran alone around them (``alone``: :attr:`Rehearsed.alone`), and what its host work read
    against the price of the plan it ran (``read``: ``host_calibration.ratios``, as measured)."""
    def ms(field: str) -> str:
        return ", ".join(f"{getattr(c, field) * 1e3:.1f}" for c in clock)

    said = (f"rehearsal clock {k}: steps of {ms('step_s')} ms; the training thread waited {ms('waited_s')} ms "
            f"of them for the host optimizer, whose work took {ms('host_s')} ms")
    if any(c.gc_s >= GC_PAUSE_S for c in clock):
        said += f"; Python's full garbage collections took {ms('gc_s')} ms of them"
    if read:
        said += f"; its host work read {read[0]:.2f}x the plan's price of the updates, {read[1]:.2f}x of the sums"
    if alone:
        runs = "; ".join(f"{a:.2f}x/{b:.2f}x" for a, b in alone)
        said += f"; the host kernel alone ran {runs} its profiled rate before/after them"
        if len(alone) > 1:
            said += f" (the steps ran {len(alone)} times, the host disturbed before the last)"
        if not settled(alone[-1]):
            said += (" (still disturbed: its host work counts at most at the plan's price times the kernel's "
                     "slowdown alone on both sides)")
    return said


def _host_clock(engine: "MemFerry") -> tuple[float, float]:
    """Seconds so far of the training thread's waits for the host optimizer, and of its work."""
    clock = engine.optimizer.clock
    return clock.time_s["consumer_wait"] + clock.time_s["zone_wait"], clock.work_s()


def _rehearse(engine: "MemFerry", sample: tuple[Any, Any], timed: bool = False) -> Rehearsed:
    """Steps at learning rate 0 on ``sample`` (:class:`Rehearsed` says what is measured).
    Untimed: one step of at most two micro-batches (a later micro-batch also holds the earlier
    ones' device gradients, so two show the peak). Timed: :data:`RATE_STEPS` steps of
    ``engine.micro.steps`` micro-batches, the host's work timed from the second-to-last
    ``step()`` to the last (see the module docstring), and the last :data:`CLOCKED_STEPS` on the
    wall clock; the steps run again, up to :data:`SETTLE_TRIES` times, while the host kernel
    alone ran disturbed around them (``host_calibration.settled``)."""
    inputs, targets = sample
    backend, device = engine.backend, engine.device
    n = engine.micro.steps if timed else min(engine.micro.steps, 2)
    steps = RATE_STEPS if timed else 1
    engine.set_lr(0.0)
    # Dropout draws random numbers: the run's random streams start where they would without this step.
    forked = [] if backend.caps.virtual_devices else [device]
    # Plain steps, as the plan prices them: the same sample again would clip every step or none.
    unclipped = engine.clip.suspended() if engine.clip is not None else contextlib.nullcontext()
    with unclipped, torch.random.fork_rng(devices=forked, device_type=backend.device(device).type):
        backend.synchronize(device)
        # What earlier work left cached (the profiler's runs, a previous attempt's engine) would
        # count as this plan's reserved peak: every attempt at 8 GB, margins 10 to 35 %, "peaked"
        # at 8.1 GB reserved (Qwen2-1.5B shape, H200, 2026-12-04).
        start_peak(backend, device)
        # The host as the steps find it, alone before and after them; while it ran slow alone
        # too (something else had it), the steps are rehearsed again (host_calibration.py).
        alone: list[tuple[float, float]] = []
        while True:
            before = alone_slowdown(engine) if timed else None
            host, send_s, clocked = _steps(engine, inputs, targets, n, steps, timed)
            engine.synchronize()
            after = alone_slowdown(engine) if before is not None else None
            if after is None:
                break
            alone.append((before, after))
            if settled(alone[-1]) or len(alone) > SETTLE_TRIES:
                break
    engine.set_lr(engine.cfg.lr)
    return Rehearsed(measured_peak(backend, device), backend.memory_stats(device).peak_allocated, host, send_s,
                     tuple(clocked), tuple(alone))


def _steps(engine: "MemFerry", inputs: Any, targets: Any, n: int, steps: int,
           timed: bool) -> tuple[tuple[float, float] | None, float | None, list[Clocked]]:
    """``steps`` steps of ``n`` micro-batches for :func:`_rehearse`: (host work, send seconds,
    clocked steps) as :class:`Rehearsed` has them, all None or empty untimed."""
    backend, device = engine.backend, engine.device
    clocked: list[Clocked] = []
    post = engine.executor.post
    sends = (0, 0.0)
    start = host = None
    collections = FullCollections()
    for k in range(steps):
        clock = timed and k >= steps - CLOCKED_STEPS
        if clock:
            backend.synchronize(device)
            if not clocked:
                sends = (post.earlier_sends, post.earlier_seconds)
            w0, h0 = _host_clock(engine)
            t0 = time.perf_counter()
        with collections:
            for _ in range(n):
                loss = engine._loss(inputs, targets)  # held through backward, as a loop that logs it holds it
                engine.backward(loss / n)
                del loss
            engine.step()
            if timed and k == steps - 2:
                start = engine.optimizer.counters()  # not waiting: this step's updates go on beside the next
            if clock:
                backend.synchronize(device)
        collections.step_done()
        if clock:
            t1 = time.perf_counter()
            w1, h1 = _host_clock(engine)
            clocked.append(Clocked(t1 - t0, w1 - w0, h1 - h0, collections.steps[-1]))
        if timed and k == steps - 1:
            host = engine.optimizer.split_since(start)  # updates still under way are left out
    return host, (send_seconds(post, sends) if clocked else None), clocked


def start_peak(backend: Any, device: int) -> None:
    """Measure a peak from here, as a rehearsal step is measured: the allocator's cached blocks
    given back first (what earlier work left cached would count as this plan's reserved peak),
    then the peaks reset (:func:`measured_peak` reads them)."""
    backend.release_cache(device)
    backend.reset_peak_memory(device)


def measured_peak(backend: Any, device: int) -> int:
    """The peak since :func:`start_peak` that a budget binds: reserved or allocated bytes,
    whichever is more."""
    stats = backend.memory_stats(device)
    return max(stats.peak_allocated, stats.peak_reserved)


def send_seconds(post: Any, since: tuple[int, float]) -> float | None:
    """The issuing thread's mean seconds per gradient send of micro-batches before a step's last
    since ``since`` (``GradientPost.earlier_sends``, ``earlier_seconds`` then); None where none
    was sent (no block sums on the host)."""
    sent = post.earlier_sends - since[0]
    return (post.earlier_seconds - since[1]) / sent if sent else None


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
