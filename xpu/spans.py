"""Named spans for profiler traces that cost nothing while no profiler records.

``torch.profiler.record_function`` enters and leaves through dispatched operators, and a
dispatched operator lets the GIL go and takes it back. A thread beside another running Python
waits for it on the way back: on the development machine a span cost 5-6 µs alone and 24-69 µs
beside a busy Python thread, where a call that keeps the GIL cost the same either way
(bench/results/2026-12-06-cpu-session43/gil_spans.txt). The host optimizer's worker opened one for
every piece of every update, 512 a step at 128 layers, whose steps ran 42 ms a step beyond their
host work in no timed phase (H100, bench/results/2026-12-06-h100-session43/). Outside a profiler
the span records nothing, so :func:`span` opens one only while a profiler records.

Whether one records is asked of ``torch.autograd.profiler``'s process-wide flag (set by
``torch.profiler.profile``, ``emit_nvtx`` and ``emit_itt``): a plain Python read. The C query
(``torch._C._autograd._profiler_enabled``) answers for the calling thread only, False on a worker
thread even while a profiler records every thread (``profile_all_threads``, as the benchmark's
timelines do), which would drop the host optimizer's lane from them.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch.autograd import profiler as _autograd_profiler

__all__ = ["profiling", "span"]

_NO_SPAN = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch profiler (or ``emit_nvtx``/``emit_itt``) records in this process now
    (True where this torch lacks the flag: every span is then opened, as before)."""
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", True))


def span(name: str | Callable[[], str]) -> ContextManager[object]:
    """``torch.profiler.record_function(name)`` while :func:`profiling`, else a context that does
    nothing. ``name`` may be a callable, called only then (no string built per piece of work)."""
    if not profiling():
        return _NO_SPAN
    return torch.profiler.record_function(name() if callable(name) else name)
