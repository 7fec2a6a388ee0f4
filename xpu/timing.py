"""Timing device work with a backend's events: the one event timer every measurement uses.

The host clock would time the launch, not the work; two events recorded around ``fn`` on a
stream and read once the second has completed time what the device did.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

from .backend import Backend

__all__ = ["event_seconds", "median_event_seconds"]


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
