"""A rehearsal's steps, run and measured: the device's peak, the host optimizer's work, each
clocked step's wall time, waits and full garbage collections, and the host kernel alone around them.

``rehearsal.py`` decides what to do with the figures (plan again for memory, calibrate the host
rate); this module only runs the steps at learning rate 0 and reads them. Where the plan's host
rate is to be checked, a rehearsal is :data:`RATE_STEPS` whole steps of the run's own
micro-batch count, the host updates timed from the second step's ``step()`` to the third's (the
second step's updates beside the third step's forward, and the third's own summing and
updates, as a training step mixes them: ``rehearsal.py`` says why), and the last
:data:`CLOCKED_STEPS` on the wall clock one by one. The host kernel is timed alone just before and
after the steps (``host_calibration.alone_slowdown``); while it ran slower than profiled on
either side, the steps run again, up to ``host_calibration.SETTLE_TRIES`` times.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from xpu.gc_clock import PAUSE_S, FullCollections
from xpu.stream_pools import describe

from .host_calibration import SETTLE_TRIES, alone_slowdown, settled

if TYPE_CHECKING:
    from .engine import MemFerry

__all__ = ["RATE_STEPS", "CLOCKED_STEPS", "GC_PAUSE_S", "Rehearsed", "Clocked", "clock_note", "rehearse",
           "start_peak", "measured_peak", "send_seconds"]

#: Whole steps of a rehearsal that checks the host rate; the last one's updates are timed.
RATE_STEPS = 3
#: Of those, the last steps timed on the wall clock, one by one (their mean is the rehearsed
#: step): one alone varied by 1-2 % on the H200, the size of the gaps ``sum_placement.py`` judges.
CLOCKED_STEPS = 2
#: Full garbage collections in a clocked step worth a word in its note (``xpu.gc_clock.PAUSE_S``,
#: as the benchmark's rows say them).
GC_PAUSE_S = PAUSE_S


class Rehearsed(NamedTuple):
    """What :func:`rehearse` measured.

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
        by_stream: the reserved bytes by stream as the steps left them, before the cache is
            given back (``xpu.stream_pools.describe``; a pool stays at its own high point), on
            one line; empty where the backend does not say.
    """

    peak: int
    allocated: int
    host: tuple[float, float] | None = None
    send_s: float | None = None
    clock: tuple["Clocked", ...] = ()
    alone: tuple[tuple[float, float], ...] = ()
    by_stream: str = ""

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


def rehearse(engine: "MemFerry", sample: tuple[Any, Any], timed: bool = False) -> Rehearsed:
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
    executor = engine.executor
    streams = {"compute": backend.current_stream(device), "h2d": executor.h2d, "d2h": executor.d2h}
    return Rehearsed(measured_peak(backend, device), backend.memory_stats(device).peak_allocated, host, send_s,
                     tuple(clocked), tuple(alone), describe(backend.reserved_by_stream(device, streams)))


def _steps(engine: "MemFerry", inputs: Any, targets: Any, n: int, steps: int,
           timed: bool) -> tuple[tuple[float, float] | None, float | None, list[Clocked]]:
    """``steps`` steps of ``n`` micro-batches for :func:`rehearse`: (host work, send seconds,
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
