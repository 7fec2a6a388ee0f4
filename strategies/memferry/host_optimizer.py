"""AdamW on the host, one unit at a time, in a worker thread that overlaps the device.

A unit's update starts as soon as its gradient has landed in host memory, while the device
goes on with the rest of backward. It updates the fp32 master in place and rewrites the
compute-dtype working copy, which is where the next forward reads weights from: there is no
separate upload phase. Consumers wait per unit (:meth:`HostOptimizer.wait`), so the next
forward of unit *i* starts as soon as unit *i* is updated.

Global-norm clipping (``max_grad_norm``) needs every gradient before the coefficient is known
(``clip_norms.py``): ``clip_mode="wait"`` holds every update until :meth:`finish_step` brings it;
``"speculative"`` updates with coefficient 1 while backward goes on and, at the finish, commits or
re-applies from the old values, bit-equal to ``"wait"`` (``speculative_clip.py``; a split update's
first pass, ``split_update.py``, changes no state, so it is made again instead). Either way an
update is published only at the finish. Norms and landed gradients go before speculative pieces,
so the coefficient is not held up; the unit expected to land last is not speculated. Which
landed gradient goes first: ``AdamW.host_order`` (``host_tasks.py``).

Gradient accumulation: a gradient submitted with ``final=False`` (an earlier micro-batch) is only
added into the unit's fp32 ``grad_acc``; the one with ``final=True`` is added by the update (held,
with clipping) as it reads the sum (``landing_zones.py``). :meth:`flush` updates from what was
accumulated when the step ends early. A unit summed on the device (``accumulate="device"``) is
submitted once per step with ``summed=True``: its whole fp32 sum has landed in ``grad_acc``.
"""
from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch

from xpu.spans import span

from .clip_norms import GlobalNormClip, PendingClip
from .config import AdamW
from .data_parallel import DataParallel
from .host_clock import ClockReadings, HostClock
from .host_kernel import make_host_kernel
from .host_tasks import TaskBoard, deadline_of
from .landing_zones import LandingZones
from .shadow import UnitShadow
from .speculative_clip import ClipSpeculation
from .split_update import SplitUpdates, updates_split

__all__ = ["HostOptimizer"]


class HostOptimizer(ClockReadings, ClipSpeculation):
    """A worker thread applying AdamW to units' host buffers (its clock's readings:
    :class:`~.host_clock.ClockReadings`; its work under clipping:
    :class:`~.speculative_clip.ClipSpeculation`).

    Args:
        cfg: optimizer settings.
        shadows: all units' buffers, by unit index.
        dp: data-parallel set-up; the update of a unit in ``whole_on_host`` is followed by the
            exchange of weight shards on the host.
        whole_on_host: indices of units whose whole working copy is read in host memory (DHA):
            under data parallelism only these exchange updated shards on the host; the others
            are loaded shard by shard and all-gathered on the devices.
        bind: called first in the worker thread, e.g. to make the engine's device the thread's
            current one (a new thread starts on device 0: waiting on an event there would open
            a context on device 0 in every rank's process).
        backup: fp32 arena for speculative clipping's backups (``ShadowModel.backup``); used
            when ``cfg.speculative``; None or empty: every clipped update waits.
        clip: global-norm clipping (``clip_norms.py``; None: without ``max_grad_norm``). For the
            units in its ``device_normed`` the worker reads no gradient for the norm but the
            running sum that landed with it (``GlobalNormClip.partials``); it sums the others'
            squares, and stops speculating once the two parts so far make the step clip
            (``clip_norms.clips``).
        steps: micro-batches per optimizer step (``MemFerry(accumulation_steps=...)``).
    """

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], dp: DataParallel | None = None,
                 bind: Callable[[], None] | None = None, whole_on_host: frozenset[int] = frozenset(),
                 backup: torch.Tensor | None = None, clip: GlobalNormClip | None = None, steps: int = 1) -> None:
        self.cfg = cfg
        self._clip = clip
        self.whole_on_host = whole_on_host
        self._bind = bind
        self.dp = dp
        self.shadows = shadows
        self.kernel = make_host_kernel(cfg.host_kernel, cfg, [s for s in shadows if s.home == "host"])
        self._done = [threading.Event() for _ in shadows]  # unit i's working copy holds its latest update
        for ev in self._done:
            ev.set()
        # Without clipping nothing but the update reads a step's gradient: it may add the last micro-batch itself.
        self._zones = LandingZones(shadows, self.kernel, cfg.max_grad_norm is None and clip is None, steps)
        self._open: set[int] = set()  # training side: units with accumulated gradients and no update queued
        self._tasks: queue.Queue = queue.Queue()
        # Worker side: the tasks in the order the device needs their results (host_tasks.py), and
        # updates under way that yielded to a more urgent one: unit index -> (pieces left, its step
        # once done, the shadow's counter that says so). Data parallelism keeps arrival order.
        by_deadline = dp is None and cfg.host_order == "deadline"
        self._board = TaskBoard(self._tasks, deadline_of([s.unit.is_block for s in shadows]) if by_deadline else None)
        self._paused: dict[int, tuple[Iterator[dict[str, float]], int, str]] = {}
        self._split = SplitUpdates(self.kernel, shadows, updates_split(cfg, dp is not None))  # split_update.py
        self._lr = cfg.lr  # worker side: the rate the kernel applies now
        self._start_clipping(backup)  # speculative_clip.ClipSpeculation
        self._error: BaseException | None = None
        #: seconds per phase, parameters updated, sums of earlier micro-batches (``host_clock.py``)
        self.clock = HostClock()
        self._thread = threading.Thread(target=self._run, name="memferry-host-adamw", daemon=True)
        self._thread.start()
        # Stop the worker when this object goes, or at interpreter exit if nobody closed the engine:
        # a worker killed mid-update at exit aborts the process ("terminate called").
        self._finalizer = weakref.finalize(self, _stop_worker, self._tasks, self._thread)

    # ------------------------------------------------------------------ producer side
    def submit(self, index: int, ready: Callable[[], None], final: bool = True,
               landed: Callable[[], bool] | None = None, summed: bool = False, zone: int = 0) -> None:
        """Queue unit ``index``'s gradient; ``ready()`` blocks until it is in host memory.

        ``final``: the step's last micro-batch: update from it (plus what was accumulated);
        otherwise it is only added into the unit's fp32 accumulation buffer. ``landed()``: whether
        it is in host memory already, without blocking (an event's ``query``): the worker goes on
        with speculative updates until it is (None: it waits on ``ready``). ``summed``: the step's
        complete fp32 sum lands in ``grad_acc`` (summed on the device): update from it as it is.
        ``zone``: where it landed, ``grad_stage`` (0) or a paired unit's ``grad_stage2`` (1): a
        gradient in zone 0 waits for the one in zone 1 and both are summed in one pass.
        """
        self._raise_if_failed()
        if summed and (not final or self.shadows[index].grad_acc is None):
            raise ValueError(f"unit {self.shadows[index].unit.name}: a summed gradient is the step's whole gradient "
                             "(final=True) and lands in the accumulation buffer (accumulation_steps > 1)")
        if not final and self.shadows[index].grad_acc is None:
            raise RuntimeError(f"unit {self.shadows[index].unit.name} has no gradient accumulation buffer; "
                               "give MemFerry(accumulation_steps=N) to accumulate gradients over N backward() calls")
        self._zones.take(index, zone)
        if final:
            self._done[index].clear()
            self._open.discard(index)
        else:
            self._open.add(index)
        self._tasks.put(("grad", index, (ready, final, landed, summed, zone)))

    def flush(self) -> None:
        """The step ends before its last micro-batch: update every unit from what it accumulated."""
        self._raise_if_failed()
        for index in self._open:
            self._done[index].clear()
        self._open.clear()
        self._tasks.put(("flush", None, None))

    def wait_consumed(self, index: int, zone: int = 0) -> None:
        """Block until the gradient in unit ``index``'s landing ``zone`` has been read (it is free)."""
        t0 = time.perf_counter()
        self._zones.wait_free(index, zone, self._raise_if_failed)
        self.time_s["zone_wait"] += time.perf_counter() - t0

    def grad_sqnorm(self) -> float:
        """Squared 2-norm of this step's host gradients; waits until all submitted ones are in.

        Only with clipping (otherwise updates do not wait and nothing is measured).
        """
        return self._ask("norm")

    def clip_counts(self) -> dict[str, int]:
        """:attr:`clip_stats` once every queued task is done (a copy)."""
        return self._ask("stats")

    def reset_counters(self) -> None:
        """Zero :attr:`time_s`, :attr:`updated_numel` and :attr:`clip_stats`, and forget the last
        step's unit count (after the engine's rehearsal step; waits for queued work)."""
        self._ask("reset")

    def settle(self) -> None:
        """Block until every landed gradient that will be updated speculatively has been: which
        units speculate then depends on nothing but the order of calls (tests count them)."""
        self._ask("settle")

    def _ask(self, kind: str) -> Any:
        """Queue ``kind`` behind everything submitted and block for the worker's reply."""
        result: queue.Queue = queue.Queue(maxsize=1)
        self._tasks.put((kind, None, result.put))
        while True:
            self._raise_if_failed()
            try:
                return result.get(timeout=0.5)
            except queue.Empty:
                continue

    def finish_step(self, coef: float | PendingClip = 1.0) -> None:
        """All gradients of this step are submitted; with clipping, apply the held updates
        with gradients scaled by ``coef`` (a float, or a ``PendingClip`` the worker reads once it
        has landed, speculating meanwhile)."""
        self._raise_if_failed()
        if self.cfg.max_grad_norm is not None:
            self._tasks.put(("finish", coef, None))

    def wait(self, index: int) -> None:
        """Block until unit ``index`` holds its latest update."""
        if not self._done[index].is_set():
            t0 = time.perf_counter()
            while not self._done[index].wait(timeout=0.5):
                self._raise_if_failed()
            self.time_s["consumer_wait"] += time.perf_counter() - t0
        self._raise_if_failed()

    def wait_all(self) -> None:
        """Block until every submitted update is applied (split ones' second passes too)."""
        for i in range(len(self.shadows)):
            self.wait(i)
        if self._split.units:
            self._ask("drain")

    def sync_steps_from_shadows(self) -> None:
        """Take step counts from the shadows (after loading a checkpoint)."""
        for s in self.shadows:
            if s.home == "host":
                self.kernel.sync_step(s)

    def set_lr(self, lr: float) -> None:
        """Learning rate for updates of gradients submitted from now on (a schedule calls this
        per step). Queued behind earlier updates, so none of those sees the new rate."""
        self._raise_if_failed()
        self._tasks.put(("lr", lr, None))

    def close(self) -> None:
        """Stop the worker after the queued work; every unit's state back in its own buffers."""
        self._finalizer()
        if self._backups is not None:
            self._backups.restore(self.shadows)

    # ------------------------------------------------------------------ worker side
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the host optimizer failed; training state is no longer consistent") from self._error

    def _run(self) -> None:
        if self._bind is not None:
            try:
                self._bind()
            except BaseException as exc:
                self._fail(exc)
                return
        if self.cfg.host_threads is not None:
            torch.set_num_threads(self.cfg.host_threads)  # this thread's OpenMP team
        # Tasks are (kind, argument, callback): ("grad", unit index, (ready, final, landed, summed, zone)),
        # ("flush", None, None), ("norm" | "stats" | "settle" | "reset" | "drain", None, reply), ("finish",
        # clip coefficient, None), ("lr", rate, None), ("stop", None, None).
        while True:
            try:
                kind, arg, callback = self._take()
                if kind in ("stop", "reset", "drain"):  # the state whole first
                    self._split.drain(self.clock)
                if kind == "stop":
                    return
                if kind == "drain":
                    callback(None)
                if kind == "grad":
                    ready, final, _, summed, zone = callback
                    t0 = time.perf_counter()
                    ready()
                    self.time_s["wait"] += time.perf_counter() - t0
                    self._receive(arg, final, summed, zone)
                elif kind == "flush":
                    called = self.kernel.sum_call_s
                    due, seconds = self._zones.flush()
                    self.clock.add_sum(seconds, earlier=False)
                    self.clock.sums_called(self.kernel.sum_call_s - called)
                    for i in due:
                        self._finalize(i)
                elif kind == "norm":
                    callback(math.fsum(self._sq_terms))  # exactly rounded: any order units finish in
                elif kind == "stats":
                    callback(dict(self.clip_stats))
                elif kind == "reset":
                    self.clock.reset()
                    self.clip_stats = dict.fromkeys(self.clip_stats, 0)
                    self._expect = None
                    callback(None)
                elif kind == "settle":
                    while self._running is not None or self._to_speculate:
                        self._speculate_piece()
                    callback(None)
                elif kind == "lr":
                    self._finish_running()  # a unit's update uses one rate throughout
                    self.kernel.set_lr(arg)
                    self._lr = arg
                elif kind == "finish":
                    self._resolve(arg)
            except BaseException as exc:
                self._fail(exc)
                return

    def _take(self) -> tuple:
        """The next task, the most urgent first (``host_tasks.py``). Between tasks, a piece at a
        time: paused updates that are due sooner than every landed task, and speculative updates
        while no task can be worked on at once (none has landed, or the clip is on its way)."""
        while True:
            due = self._running is not None or bool(self._to_speculate) or self._split.waiting()
            idle = not (due or self._paused)
            t0 = time.perf_counter()
            self._board.fill(block=idle)
            if idle:
                self.time_s["idle"] += time.perf_counter() - t0
            pick = self._board.next(self._paused)
            if isinstance(pick, int):
                self._resume(pick)
                continue
            if pick is None:
                if due:
                    self._background_piece()
                    continue
                pick = self._board.backlog[0]  # nothing has landed: wait for the first to land
            kind, arg, _ = pick
            waits = (not self._board.landed(pick)  # a gradient still on its way home
                     or kind == "finish" and isinstance(arg, PendingClip) and not arg.ready())
            if due and waits:
                self._background_piece()
                continue
            self._board.remove(pick)
            return pick

    def _receive(self, index: int, final: bool, summed: bool = False, zone: int = 0) -> None:
        """A landed gradient: summed where it must be (``landing_zones.py``); update if final."""
        called = self.kernel.sum_call_s
        self.clock.add_sum(self._zones.receive(index, final, summed, zone), earlier=not final)
        self.clock.sums_called(self.kernel.sum_call_s - called)
        if final:
            self._finalize(index)

    def _finalize(self, index: int) -> None:
        """The step's gradient of unit ``index`` is complete: update now, or hold it for the clip
        (:meth:`~.speculative_clip.ClipSpeculation._hold`)."""
        s = self.shadows[index]
        self._zones.complete(index)
        self._split.finish(index, self.clock)  # the last step's second pass: this update reads its state
        if self.cfg.max_grad_norm is None:
            split = self._split.splits(index)
            if self._board.deadline is None and not split:
                self._update(index, 1.0)
            else:  # a piece at a time, so a unit the next forward needs sooner can go first
                pieces = self._split.first(index) if split else self.kernel.pieces(s, 1.0)
                self._paused[index] = (pieces, s.step + 1, "copied" if split else "step")
            return
        self._hold(index)

    def _background_piece(self) -> None:
        """A piece of work nothing landed waits for: a speculative update, else a second pass."""
        if self._running is not None or self._to_speculate:
            self._speculate_piece()
        else:
            self._split.piece(self.clock)

    def _resume(self, index: int) -> None:
        """One piece of unit ``index``'s paused update; publish it after the last."""
        pieces, done_step, counter = self._paused[index]
        s = self.shadows[index]
        with span(lambda: f"optimizer:host {s.unit.name}"):
            times = next(pieces, {})
        done = getattr(s, counter) == done_step  # the kernel counts the step with its last piece
        self._count(index, times, done)
        if done:
            del self._paused[index]
            self._publish(index)
            if counter == "copied":
                self._split.queue(index)

    def _count(self, index: int, times: dict[str, float], done: bool) -> None:
        """Add a piece's seconds per phase; ``done``: unit ``index``'s update is complete."""
        self.clock.count(index, times, done, self.shadows[index].master.numel())

    def _fail(self, exc: BaseException) -> None:
        """Keep ``exc`` for the training thread (``_raise_if_failed``) and release every waiter."""
        self._error = exc
        self._zones.release_all()
        for ev in self._done:
            ev.set()

    def _update(self, index: int, coef: float, source: Any = None) -> None:
        """Update unit ``index`` (from ``source``'s master and moments if given) and publish it."""
        s = self.shadows[index]
        # A named span, so a profiler trace (the benchmark's timelines) shows host updates
        # on the CPU optimizer lane beside the device's backward.
        with span(lambda: f"optimizer:host {s.unit.name}"):
            self._count(index, self.kernel.apply(s, coef, source=source), done=True)
            self._publish(index)

    def _publish(self, index: int) -> None:
        """Unit ``index``'s update is final: free its landing zone, exchange shards, release waiters."""
        s = self.shadows[index]
        self._zones.free(index)
        if self.dp is not None and index in self.whole_on_host:
            t0 = time.perf_counter()
            self.dp.gather(s.work)  # read whole in place by DHA: every rank's copy whole again
            self.time_s["writeback"] += time.perf_counter() - t0
        self._done[index].set()


def _stop_worker(tasks: queue.Queue, thread: threading.Thread) -> None:
    tasks.put(("stop", None, None))
    thread.join(timeout=60)
