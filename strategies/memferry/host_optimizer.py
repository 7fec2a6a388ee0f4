"""AdamW on the host, one unit at a time, in a worker thread that overlaps the device.

A unit's update starts as soon as its gradient has landed in host memory, while the device
goes on with the rest of backward. It updates the fp32 master in place and rewrites the
compute-dtype working copy, which is where the next forward reads weights from: there is no
separate upload phase. Consumers wait per unit (:meth:`HostOptimizer.wait`), so the next
forward of unit *i* starts as soon as unit *i* is updated.

Global-norm clipping needs every gradient before any update. With ``max_grad_norm`` set,
the worker still receives, upcasts and measures each unit's gradient during backward, and
applies all updates once :meth:`finish_step` supplies the clip coefficient (from
:meth:`grad_sqnorm` and the device units' norms): exact, less overlap.

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
from typing import Callable

import torch

from .config import AdamW
from .data_parallel import DataParallel
from .host_kernel import make_host_kernel
from .shadow import UnitShadow

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
    """

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], dp: DataParallel | None = None,
                 bind: Callable[[], None] | None = None, whole_on_host: frozenset[int] = frozenset()) -> None:
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
        self._pending: list[int] = []
        self._sqnorm = 0.0
        self._error: BaseException | None = None
        #: seconds spent per phase, for the scheduler's cost model: waiting for gradients to
        #: land, upcasting them, the AdamW kernel, writing the compute-dtype copy; and
        #: ``consumer_wait``: how long callers of :meth:`wait` (the next forward) were blocked.
        self.time_s = {"wait": 0.0, "upcast": 0.0, "adamw": 0.0, "writeback": 0.0, "consumer_wait": 0.0}
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
        result: "queue.Queue[float]" = queue.Queue(maxsize=1)
        self._tasks.put(("norm", None, result.put))
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
        under data parallelism includes the weight exchange; not the waits), the figure the
        scheduler's profile predicts; None before any update."""
        if not self.updated_numel:
            return None
        work = self.time_s["upcast"] + self.time_s["adamw"] + self.time_s["writeback"]
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
                elif kind == "lr":
                    self.kernel.set_lr(arg)
                elif kind == "finish":
                    for i in self._pending:
                        self._update(i, arg)
                    self._pending, self._sqnorm = [], 0.0
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
        else:
            self._sqnorm += float(s.grad_source.double().square().sum())
            self._pending.append(index)

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
        s = self.shadows[index]
        for phase, seconds in self.kernel.apply(s, coef).items():
            self.time_s[phase] += seconds
        s.accumulated = False
        self._consumed[index].set()
        self.updated_numel += s.master.numel()
        if self.dp is not None and index in self.whole_on_host:
            t0 = time.perf_counter()
            self.dp.gather(s.work)  # read whole in place by DHA: every rank's copy whole again
            self.time_s["writeback"] += time.perf_counter() - t0
        self._done[index].set()


def _stop_worker(tasks: queue.Queue, thread: threading.Thread) -> None:
    tasks.put(("stop", None, None))
    thread.join(timeout=60)
