"""``xpu.spans``: a profiler span only while a profiler records (a span lets the GIL go and takes it
back; outside a profiler it records nothing), and then on every thread the profiler records."""
from __future__ import annotations

import threading

import torch

from xpu.spans import profiling, span


def _names(prof) -> set[str]:
    return {e.name for e in prof.events()}


def test_no_span_and_no_name_built_while_no_profiler_records():
    built = []
    assert not profiling()
    with span(lambda: built.append(1) or "never"):
        pass
    assert built == [] and span("a") is span("b")  # one shared context that does nothing


def test_a_span_is_recorded_while_a_profiler_records_and_not_after():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling()
        with span(lambda: "xpu-span-callable"):
            torch.ones(3).sum()
        with span("xpu-span-name"):
            torch.ones(3).sum()
    assert {"xpu-span-callable", "xpu-span-name"} <= _names(prof)
    assert not profiling()


def test_a_worker_thread_s_span_is_recorded_when_the_profiler_records_every_thread():
    """A thread started before the profiler (as the host optimizer's worker is) sees it record:
    the thread-local C query would say no there, and the benchmark's timelines would lose the
    optimizer's lane."""
    try:
        every = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):  # an older torch records the profiling thread only
        every = {}
    go, done, seen = threading.Event(), threading.Event(), []

    def worker():
        go.wait()
        seen.append(profiling())
        with span("xpu-span-worker"):
            torch.ones(3).sum()
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **every) as prof:
        go.set()
        done.wait(30)
    thread.join()
    assert seen == [True]
    if every:
        assert "xpu-span-worker" in _names(prof)
