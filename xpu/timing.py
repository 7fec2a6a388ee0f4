"""Timing device work with a backend's events: the one event timer every measurement uses.

The host clock would time the launch, not the work; two events recorded around ``fn`` on a
stream and read once the second has completed time what the device did.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from .backend import Backend

__all__ = ["event_seconds", "median_event_seconds", "occupy", "pipelined_seconds"]

#: Side of the square fp32 products :func:`occupy` queues (two such matrices: 32 MiB of device memory).
OCCUPY_SIDE = 2048
#: Most products :func:`occupy` queues at once (a bound on a very slow device's share of the host).
OCCUPY_MAX = 256
_product_s: dict[tuple[int, int], float] = {}  # (id of backend, device) -> seconds of one product


def event_seconds(backend: Backend, stream: Any, fn: Callable[[], Any]) -> float:
    """Seconds of the device work ``fn`` issues on ``stream`` (``fn`` runs with ``stream`` current).

    Waits for that work to finish (the end event), not for the whole device.
    """
    start, end = backend.event(timing=True), backend.event(timing=True)
    with backend.use_stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def median_event_seconds(backend: Backend, stream: Any, fn: Callable[[], Any], *, repeats: int = 3,
                         warmup: int = 1) -> float:
    """Median of :func:`event_seconds` over ``repeats`` runs of ``fn`` after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        event_seconds(backend, stream, fn)
    return statistics.median(event_seconds(backend, stream, fn) for _ in range(repeats))


def occupy(backend: Backend, device: int, stream: Any, seconds: float) -> None:
    """Queue about ``seconds`` of device work on ``stream`` (square fp32 products, their count from
    one product timed the first time on this device), and return without waiting for it: what is
    queued next starts only once it is done, so the host has that long to queue it."""
    key = (id(backend), device)
    a = torch.ones(OCCUPY_SIDE, OCCUPY_SIDE, device=backend.device(device))
    out = torch.empty_like(a)
    with backend.use_stream(stream):
        if key not in _product_s:
            torch.mm(a, a, out=out)  # warm: library handles, kernel selection
            _product_s[key] = max(event_seconds(backend, stream, lambda: torch.mm(a, a, out=out)), 1e-6)
        for _ in range(min(OCCUPY_MAX, math.ceil(seconds / _product_s[key]))):
            torch.mm(a, a, out=out)


def pipelined_seconds(backend: Backend, device: int, stream: Any, fn: Callable[[], Any],
                      lead_s: float) -> tuple[float, float]:
    """(device seconds, host seconds) of ``fn`` as a step that issues ahead of the device runs it.

    Alone, ``fn``'s device time as :func:`event_seconds` reads it also counts the device waiting
    for the host to issue each kernel; where a step issues work ahead of the device (autograd's
    backward, a recomputation inside it) the device runs the kernels back to back. So the device
    is first kept busy for ``lead_s`` (:func:`occupy`), long enough for ``fn`` to be issued behind
    it, and then timed. The host seconds are ``fn``'s own call (issuing, and any wait inside it):
    where they exceed the device seconds, the host bounds ``fn`` in a step too. ``lead_s`` 0 times
    as :func:`event_seconds` does.
    """
    if lead_s > 0:
        occupy(backend, device, stream, lead_s)
    host = 0.0

    def issued() -> None:
        nonlocal host
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0

    return event_seconds(backend, stream, issued), host
