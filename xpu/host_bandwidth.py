"""Host memory bandwidth, alone and while host<->device copies run beside it.

A DMA byte is a host-memory byte: pinned copies in either direction read or write the same
DRAM the CPU optimizer streams through. On the H200 machine (docs/design.md §3.3) a host AdamW
pass took 1.4-2x longer while both copy directions ran at full rate. ``xpu probe`` records the
figures here in its ``host`` section, and cost models convert host-memory bytes to time with
them.

GB/s means 10**9 bytes per second. ``copy_GBps`` counts bytes read plus bytes written;
``triad_GBps`` (``a = b + s * c``) counts its three arrays once each, as STREAM does; neither
counts the read-for-ownership a store may add. The torch ops run on torch's intra-op threads
(all cores unless the process set fewer; ``threads`` says how many).
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import torch

from .backend import Backend
from .hostmem import transparent_huge_pages

__all__ = ["CopyLoad", "measure_host", "ADAMW_BYTES_PER_PARAM"]

#: Host-memory bytes of one fp32 AdamW step per parameter: the gradient read, the parameter
#: and both moments read and written.
ADAMW_BYTES_PER_PARAM = 28


class CopyLoad:
    """Host->device and device->host copies in a background thread, busy ``duty`` of the time
    (1: back to back), as a training step's prefetches and gradient copies load host memory.

    Use as a context manager; :attr:`rate_GBps` is then the bytes both directions moved per
    second of the load's life. The thread waits on each round by polling an event with short
    sleeps, not by a blocking synchronize, which may spin a core the measured work needs.
    On a backend without asynchronous copies (the cpu reference) the copies are memcpys in the
    thread itself.

    Args:
        backend: the backend whose copy engines load host memory.
        device: the device copied to and from.
        duty: share of the time the copies run, in (0, 1].
        nbytes: size of each direction's buffer.

    Raises:
        ValueError: ``duty`` outside (0, 1] or ``nbytes`` below 1.
    """

    def __init__(self, backend: Backend, device: int, duty: float = 1.0, nbytes: int = 32 << 20) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty must lie in (0, 1], got {duty}")
        if nbytes < 1:
            raise ValueError(f"nbytes must be a positive byte count, got {nbytes}")
        self.backend, self.device, self.duty = backend, device, duty
        arena = backend.host_arena
        self.host = [arena.empty(nbytes, torch.uint8), arena.empty(nbytes, torch.uint8)]
        with backend.device_scope(device):
            self.dev = [backend.empty(nbytes, torch.uint8, device), backend.empty(nbytes, torch.uint8, device)]
            self.streams = [backend.stream(device), backend.stream(device)]
        self.nbytes = nbytes
        self.moved = 0
        self._span = (0.0, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xpu-copy-load", daemon=True)

    def _run(self) -> None:
        b = self.backend
        with b.device_scope(self.device):
            while not self._stop.is_set():
                t0 = time.perf_counter()
                b.copy(self.dev[0], self.host[0], stream=self.streams[0])  # host -> device
                b.copy(self.host[1], self.dev[1], stream=self.streams[1])  # device -> host
                for st in self.streams:
                    done = b.event()
                    done.record(st)
                    while not done.query():
                        time.sleep(2e-4)
                self.moved += 2 * self.nbytes
                busy = time.perf_counter() - t0
                if self.duty < 1.0:
                    self._stop.wait(busy * (1.0 - self.duty) / self.duty)

    @property
    def rate_GBps(self) -> float:
        """Bytes moved (both directions) per second of the load's life, in GB/s (0 before it ran)."""
        t0, t1 = self._span
        return round(self.moved / (t1 - t0) / 1e9, 2) if t1 > t0 else 0.0

    def __enter__(self) -> "CopyLoad":
        self._span = (time.perf_counter(), 0.0)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._span = (self._span[0], time.perf_counter())
        for t in self.host:
            self.backend.host_arena.release(t)
        self.dev = []


def _median_s(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


def measure_host(backend: Backend, nbytes: int = 512 << 20, repeats: int = 5, warmup: int = 1, device: int = 0,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Host memory bandwidth on all of torch's threads, alone and beside full-rate copies.

    Four fp32 arrays of ``nbytes`` each (far above the CPU's cache for the figures to mean
    DRAM: the H200 machine has a 300 MiB L3). Keys: ``threads``, ``array_bytes``,
    ``copy_GBps``, ``triad_GBps``, ``adamw_ns_per_param`` (torch's fused AdamW with fp32
    gradients, :data:`ADAMW_BYTES_PER_PARAM` bytes per parameter) and, with host->device and
    device->host copies running back to back meanwhile (:class:`CopyLoad`),
    ``triad_with_copies_GBps``, ``adamw_with_copies_ns_per_param`` and ``copies_GBps`` (what
    the copies moved, both directions together); ``transparent_hugepages``: the kernel's mode
    (:func:`~xpu.hostmem.transparent_huge_pages`), which decides the pinned buffers' pages.

    Raises:
        ValueError: ``nbytes`` below 4 bytes or ``repeats`` below 1.
    """
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"measure_host needs nbytes >= 4 and repeats >= 1, got {nbytes} and {repeats}")
    say = progress or (lambda _msg: None)
    n = nbytes // 4
    a, b, c, g = (torch.empty(n, dtype=torch.float32) for _ in range(4))
    a.zero_()  # touch every page before anything is timed
    b.fill_(1.0)
    c.fill_(0.5)
    g.fill_(1e-3)

    def triad() -> None:
        torch.add(b, c, alpha=3.0, out=a)

    # AdamW over a (parameter), b and c (moments: non-negative as exp_avg_sq must be), g (gradient).
    opt = torch.optim.AdamW([a], lr=1e-6, fused=True)
    opt.state[a] = {"step": torch.tensor(0.0), "exp_avg": b, "exp_avg_sq": c}
    a.grad = g

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "array_bytes": 4 * n}
    say("host memory: copy, triad, AdamW")
    out["copy_GBps"] = _gbps(2 * 4 * n, _median_s(lambda: a.copy_(b), repeats, warmup))
    out["triad_GBps"] = _gbps(3 * 4 * n, _median_s(triad, repeats, warmup))
    out["adamw_ns_per_param"] = round(_median_s(opt.step, repeats, warmup) / n * 1e9, 4)
    say("host memory beside host<->device copies")
    with CopyLoad(backend, device, duty=1.0) as load:
        out["triad_with_copies_GBps"] = _gbps(3 * 4 * n, _median_s(triad, repeats, warmup))
        out["adamw_with_copies_ns_per_param"] = round(_median_s(opt.step, repeats, warmup) / n * 1e9, 4)
    out["copies_GBps"] = load.rate_GBps
    out["transparent_hugepages"] = transparent_huge_pages()
    a.grad = None
    return out
