"""Gradients home: a unit's device→host gradient copies and the hand-over to the host optimizer.

The copies run on the device→host stream after the compute stream's work so far (an event
orders them); the host optimizer is told at once, with the event that marks their landing, so
its worker waits for that and nothing else. With global-norm clipping, the step's whole
gradient of a unit also adds its squares to the device's running sum first, and that sum comes
home behind the copies (``clip_norms.GlobalNormClip``).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from xpu import Backend
from xpu.spans import span

from .clip_norms import GlobalNormClip
from .flat_sends import gather, host_span
from .host_optimizer import HostOptimizer

__all__ = ["GradientPost"]


class GradientPost:
    """Sends units' gradients home on ``d2h`` and submits them to ``optimizer``.

    Args:
        backend, device: where the gradients are.
        d2h: the device→host copy stream.
        optimizer: the host optimizer the gradients are submitted to; its ``cfg`` (``AdamW``)
            says how: ``landing_wait="sleep"`` makes the landing events blocking-sync (the worker
            waiting on one sleeps instead of spinning), ``flat_sends`` gathers a unit's gradients
            into one device buffer sent home in one copy where their targets lie back to back
            (``flat_sends.py``).
        clip: global-norm clipping (None without ``max_grad_norm``).
    """

    def __init__(self, backend: Backend, device: int, d2h: Any, optimizer: HostOptimizer,
                 clip: GlobalNormClip | None = None) -> None:
        self.b, self.dev, self.d2h, self.opt, self.clip = backend, device, d2h, optimizer, clip
        self.sleep, self.flat = optimizer.cfg.landing_wait == "sleep", optimizer.cfg.flat_sends
        #: bytes copied home so far
        self.bytes = 0
        #: seconds the training thread spent in :meth:`send` so far (queuing is all it should do:
        #: a copy that blocks shows here as the gradient's copy time)
        self.seconds = 0.0
        #: native ids of the threads that sent (autograd's device thread issues backward): whose
        #: waits for a core a caller may read from the OS
        self.threads: set[int] = set()
        #: sends of micro-batches before a step's last, and the seconds they took (of ``seconds``)
        self.earlier_sends = 0
        self.earlier_seconds = 0.0
        #: ``seconds`` by part: ordering after compute (``fence``), queuing the copies (``copies``),
        #: handing over to the optimizer (``submit``); and the thread's CPU time in them (``cpu``:
        #: wall far above it means the thread waited, for the GIL, a core or a driver lock)
        self.parts = dict.fromkeys(("fence", "copies", "submit", "cpu"), 0.0)

    def reset_counters(self) -> None:
        """The training thread's seconds and sends counted so far back to zero (``bytes`` and
        the thread ids stay)."""
        self.earlier_sends = 0
        self.seconds = self.earlier_seconds = 0.0
        self.parts = dict.fromkeys(self.parts, 0.0)

    def send(self, index: int, sources: list[torch.Tensor], targets: list[torch.Tensor], final: bool,
             summed: bool = False, zone: int = 0) -> None:
        """Copy gradients ``sources`` of unit ``index`` into host ``targets`` after the compute
        stream's work so far, and submit them (``final``, ``summed``, ``zone``: as
        :meth:`HostOptimizer.submit` takes them)."""
        # Named for a profiled step: bench/scripts/trace_sends.py splits these spans by the calls
        # inside them (which runtime call costs the thread its time).
        with span("grad_post:send"):
            self._send(index, sources, targets, final, summed, zone)

    def _send(self, index: int, sources: list[torch.Tensor], targets: list[torch.Tensor], final: bool,
              summed: bool, zone: int) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        self.threads.add(threading.get_native_id())
        compute = self.b.current_stream(self.dev)
        if final and self.clip is not None:
            with self.b.device_scope(self.dev):
                self.clip.add(index, sources)  # the step's whole gradient (one micro-batch, or the device's sum)
        span = host_span(targets) if self.flat else None
        computed = self.b.event()
        computed.record(compute)
        self.d2h.wait_event(computed)
        t1 = time.perf_counter()
        with self.b.device_scope(self.dev), self.b.use_stream(self.d2h):
            read = sources  # what d2h reads of the compute stream's: by the copies, or by the gather
            if span is not None:
                # Gathered on d2h (after the compute that made them, beside the next block's),
                # in a buffer of d2h's own: one copy home instead of one per tensor.
                sources, targets = [gather(self.b, sources, self.dev, span.dtype)], [span]
            # One call for the unit's tensors (already on d2h): alone, a copy per tensor cost the
            # thread 526 us a block, one call 145 (diag_grad_post.py); host-summing plans send
            # in every micro-batch.
            self.b.copy_many(targets, sources)
            for g in read:
                self.b.keep_alive(g, self.d2h)
            if final and self.clip is not None:
                self.clip.send_running_sum(index, self.d2h)
            landed = self.b.event(blocking=self.sleep)
            landed.record(self.d2h)
        self.bytes += sum(t.numel() * t.element_size() for t in targets)
        t2 = time.perf_counter()
        self.opt.submit(index, landed.synchronize, final=final, landed=landed.query, summed=summed, zone=zone)
        t3 = time.perf_counter()
        took = t3 - t0
        self.seconds += took
        cpu = time.thread_time() - c0
        for part, dt in (("fence", t1 - t0), ("copies", t2 - t1), ("submit", t3 - t2), ("cpu", cpu)):
            self.parts[part] += dt
        if not final:
            self.earlier_sends += 1
            self.earlier_seconds += took
