"""AdamW on the host, one unit at a time, in a worker thread that overlaps the device.

A unit's update starts as soon as its gradient has landed in host memory, while the device
goes on with the rest of backward. It updates the fp32 master in place and rewrites the
compute-dtype working copy, which is where the next forward reads weights from: there is no
separate upload phase. Consumers wait per unit (:meth:`HostOptimizer.wait`), so the next
forward of unit *i* starts as soon as unit *i* is updated.

Global-norm clipping needs every gradient before the coefficient is known. With
``max_grad_norm`` set, the worker measures each unit's gradient as it lands, and
:meth:`finish_step` supplies the coefficient (from :meth:`grad_sqnorm` and the device units'
norms). ``clip_mode="wait"`` holds every update until then: exact, less overlap.
``clip_mode="speculative"`` backs the unit's master and moments up (``speculative_clip.py``) and
updates at once with coefficient 1; :meth:`finish_step` then commits (coefficient 1, same
learning rate) or rolls back and re-applies: exact too, bit-equal to ``"wait"``. Either way a
unit's update is published (:meth:`wait` returns, its landing zone is freed) only at the finish.

Gradient accumulation: a gradient submitted with ``final=False`` (an earlier micro-batch of
the step) is only added into the unit's fp32 ``grad_acc``; the one submitted with
``final=True`` adds the last micro-batch and updates (or holds the update, with clipping)
from the sum. :meth:`flush` turns what was accumulated into updates when the step ends early.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from .adamw import squared_norm
from .config import AdamW
from .data_parallel import DataParallel
from .host_kernel import make_host_kernel
from .shadow import UnitShadow
from .speculative_clip import Backups

__all__ = ["HostOptimizer"]


class HostOptimizer:
    """A worker thread applying AdamW to units' host buffers.

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
    """

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], dp: DataParallel | None = None,
                 bind: Callable[[], None] | None = None, whole_on_host: frozenset[int] = frozenset(),
                 backup: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.whole_on_host = whole_on_host
        self._bind = bind
        self.dp = dp
        self.shadows = shadows
        self.kernel = make_host_kernel(cfg.host_kernel, cfg, [s for s in shadows if s.home == "host"])
        # _done[i]: unit i's working copy holds its latest update; _consumed[i]: its landing
        # zone (grad_stage) has been read, so the next micro-batch's gradient may land there.
        self._done = [threading.Event() for _ in shadows]
        self._consumed = [threading.Event() for _ in shadows]
        for ev in self._done + self._consumed:
            ev.set()
        self._received = [0] * len(shadows)  # worker side: micro-batches summed into grad_acc this step
        self._open: set[int] = set()  # training side: units with accumulated gradients and no update queued
        self._tasks: queue.Queue = queue.Queue()
        # This step's clipped units in landing order, each with the learning rate its speculative
        # update used (None: held, not yet updated).
        self._order: list[tuple[int, float | None]] = []
        self._backups = Backups(backup if backup is not None else torch.empty(0)) if cfg.speculative else None
        self._lr = cfg.lr  # worker side: the rate the kernel applies now
        #: speculative clipping, totals so far (worker side; read them with :meth:`clip_counts`):
        #: ``steps`` finished with clipping on, ``rollback_steps`` among them that restored
        #: backups, ``speculated_units``, ``rolled_back_units``, ``held_units`` (no backup room).
        self.clip_stats = {"steps": 0, "rollback_steps": 0, "speculated_units": 0, "rolled_back_units": 0,
                           "held_units": 0}
        self._sqnorm = 0.0
        self._error: BaseException | None = None
        #: seconds spent per phase, for the scheduler's cost model: waiting for gradients to
        #: land, upcasting them, the AdamW kernel, writing the compute-dtype copy; and
        #: ``consumer_wait``: how long callers of :meth:`wait` (the next forward) were blocked;
        #: ``backup``: speculative clipping's copies and restores.
        self.time_s = {"wait": 0.0, "upcast": 0.0, "adamw": 0.0, "writeback": 0.0, "consumer_wait": 0.0,
                       "backup": 0.0}
        #: parameters updated so far (this rank's shards), for :meth:`measured_s_per_param`.
        self.updated_numel = 0
        self._thread = threading.Thread(target=self._run, name="memferry-host-adamw", daemon=True)
        self._thread.start()
        # Stop the worker when this object goes, or at interpreter exit if nobody closed the
        # engine: a worker killed mid-update at exit aborts the process ("terminate called").
        self._finalizer = weakref.finalize(self, _stop_worker, self._tasks, self._thread)

    # ------------------------------------------------------------------ producer side
    def submit(self, index: int, ready: Callable[[], None], final: bool = True) -> None:
        """Queue unit ``index``'s gradient; ``ready()`` blocks until it is in host memory.

        ``final``: the step's last micro-batch: update from it (plus what was accumulated);
        otherwise it is only added into the unit's fp32 accumulation buffer.
        """
        self._raise_if_failed()
        if not final and self.shadows[index].grad_acc is None:
            raise RuntimeError(f"unit {self.shadows[index].unit.name} has no gradient accumulation buffer; "
                               "give MemFerry(accumulation_steps=N) to accumulate gradients over N backward() calls")
        self._consumed[index].clear()
        if final:
            self._done[index].clear()
            self._open.discard(index)
        else:
            self._open.add(index)
        self._tasks.put(("grad", index, (ready, final)))

    def flush(self) -> None:
        """The step ends before its last micro-batch: update every unit from what it accumulated."""
        self._raise_if_failed()
        for index in self._open:
            self._done[index].clear()
        self._open.clear()
        self._tasks.put(("flush", None, None))

    def wait_consumed(self, index: int) -> None:
        """Block until unit ``index``'s landed gradient has been read (its landing zone is free)."""
        while not self._consumed[index].wait(timeout=0.5):
            self._raise_if_failed()
        self._raise_if_failed()

    def grad_sqnorm(self) -> float:
        """Squared 2-norm of this step's host gradients; waits until all submitted ones are in.

        Only with clipping (otherwise updates do not wait and nothing is measured).
        """
        return self._ask("norm")

    def clip_counts(self) -> dict[str, int]:
        """:attr:`clip_stats` once every queued task is done (a copy)."""
        return self._ask("stats")

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

    def finish_step(self, coef: float = 1.0) -> None:
        """All gradients of this step are submitted; with clipping, apply the held updates
        with gradients scaled by ``coef``."""
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
        """Block until every submitted update is applied."""
        for i in range(len(self.shadows)):
            self.wait(i)

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

    def measured_s_per_param(self) -> float | None:
        """Seconds per parameter the updates so far took (upcast, AdamW and write-back, which
        under data parallelism includes the weight exchange, and speculative clipping's backups;
        not the waits; a rolled-back update counts twice), the figure the
        scheduler's profile predicts; None before any update."""
        if not self.updated_numel:
            return None
        work = self.time_s["upcast"] + self.time_s["adamw"] + self.time_s["writeback"] + self.time_s["backup"]
        return work / self.updated_numel

    def close(self) -> None:
        """Stop the worker after the queued work."""
        self._finalizer()

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
        # Tasks are (kind, argument, callback): ("grad", unit index, wait-for-landing),
        # ("norm", None, reply), ("finish", clip coefficient, None), ("lr", rate, None),
        # ("stop", None, None).
        while True:
            kind, arg, callback = self._tasks.get()
            if kind == "stop":
                return
            try:
                if kind == "grad":
                    ready, final = callback
                    t0 = time.perf_counter()
                    ready()
                    self.time_s["wait"] += time.perf_counter() - t0
                    self._receive(arg, final)
                elif kind == "flush":
                    for i, n in enumerate(self._received):
                        if n:
                            self._finalize(i)
                elif kind == "norm":
                    callback(self._sqnorm)
                elif kind == "stats":
                    callback(dict(self.clip_stats))
                elif kind == "lr":
                    self.kernel.set_lr(arg)
                    self._lr = arg
                elif kind == "finish":
                    self._resolve(arg)
            except BaseException as exc:
                self._fail(exc)
                return

    def _receive(self, index: int, final: bool) -> None:
        """A landed gradient: sum it into ``grad_acc`` unless it is a step's only one; update if final."""
        s = self.shadows[index]
        if final and not self._received[index]:
            s.accumulated = False  # one micro-batch: update straight from the landing zone
        else:
            t0 = time.perf_counter()
            if self._received[index]:
                self.kernel.accumulate(s.grad_acc, s.grad_stage)  # one pass, no fp32 temporary
            else:
                s.grad_acc.copy_(s.grad_stage)
            s.accumulated = True
            self._received[index] += 1
            self.time_s["upcast"] += time.perf_counter() - t0
        if s.accumulated:
            self._consumed[index].set()  # the sum holds it: the next micro-batch may land
        if final:
            self._finalize(index)

    def _finalize(self, index: int) -> None:
        """The step's gradient of unit ``index`` is complete: update now, or hold it for the clip."""
        s = self.shadows[index]
        self._received[index] = 0
        if self.cfg.max_grad_norm is None:
            self._update(index, 1.0)
            return
        self._sqnorm += float(squared_norm(s.grad_source))
        t0 = time.perf_counter()
        if self._backups is not None and self._backups.save(s):
            self.time_s["backup"] += time.perf_counter() - t0
            with torch.profiler.record_function(f"optimizer:host speculative {s.unit.name}"):
                self._kernel(index, 1.0)  # published (or rolled back) by _resolve
            self._order.append((index, self._lr))
            self.clip_stats["speculated_units"] += 1
        else:
            self._order.append((index, None))
            self.clip_stats["held_units"] += int(self._backups is not None)

    def _resolve(self, coef: float) -> None:
        """The clip coefficient is known: apply held updates; keep speculative ones that used
        coefficient 1 and the current rate, restore and re-apply the others (exactly what
        ``clip_mode="wait"`` computes). Units go in landing order on every rank (the weight
        exchange of data parallelism follows it)."""
        rolled = 0
        for index, lr in self._order:
            s = self.shadows[index]
            if lr is None:
                self._update(index, coef)
            elif coef == 1.0 and lr == self._lr:
                self._publish(index)
            else:
                t0 = time.perf_counter()
                self._backups.restore(s)
                s.step -= 1
                self.kernel.sync_step(s)
                self.time_s["backup"] += time.perf_counter() - t0
                rolled += 1
                self._update(index, coef)
        self._order, self._sqnorm = [], 0.0
        if self._backups is not None:
            self._backups.reset()
        self.clip_stats["steps"] += 1
        self.clip_stats["rollback_steps"] += int(rolled > 0)
        self.clip_stats["rolled_back_units"] += rolled

    def _fail(self, exc: BaseException) -> None:
        """Keep ``exc`` for the training thread (``_raise_if_failed``) and release every waiter."""
        self._error = exc
        for ev in self._done + self._consumed:
            ev.set()

    def _update(self, index: int, coef: float) -> None:
        # A named span, so a profiler trace (the benchmark's timelines) shows host updates
        # on the CPU optimizer lane beside the device's backward.
        with torch.profiler.record_function(f"optimizer:host {self.shadows[index].unit.name}"):
            self._apply(index, coef)

    def _apply(self, index: int, coef: float) -> None:
        self._kernel(index, coef)
        self._publish(index)

    def _kernel(self, index: int, coef: float) -> None:
        """The update itself: master, moments and working copy change; nothing is published."""
        s = self.shadows[index]
        for phase, seconds in self.kernel.apply(s, coef).items():
            self.time_s[phase] += seconds
        self.updated_numel += s.master.numel()

    def _publish(self, index: int) -> None:
        """Unit ``index``'s update is final: free its landing zone, exchange shards, release waiters."""
        s = self.shadows[index]
        s.accumulated = False
        self._consumed[index].set()
        if self.dp is not None and index in self.whole_on_host:
            t0 = time.perf_counter()
            self.dp.gather(s.work)  # read whole in place by DHA: every rank's copy whole again
            self.time_s["writeback"] += time.perf_counter() - t0
        self._done[index].set()


def _stop_worker(tasks: queue.Queue, thread: threading.Thread) -> None:
    tasks.put(("stop", None, None))
    thread.join(timeout=60)
