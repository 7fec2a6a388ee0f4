"""Threads' waits for a core (``bench/thread_waits.py``): read from Linux's schedstat, counted per thread."""
from __future__ import annotations

import os
import threading

import pytest

from bench.thread_waits import run_delays, waited_s


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's per-thread schedstat")
def test_every_thread_of_the_process_is_read_and_never_goes_back():
    seen: dict[str, int] = {}
    started, finish = threading.Event(), threading.Event()

    def other() -> None:
        seen["id"] = threading.get_native_id()
        started.set()
        finish.wait()

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    first = run_delays()
    assert threading.get_native_id() in first and seen["id"] in first
    sum(range(200_000))  # some work in between
    second = run_delays()
    finish.set()
    t.join()
    assert all(second[k] >= v for k, v in first.items() if k in second)


def test_waits_are_summed_over_the_threads_asked_for_a_new_one_from_its_start():
    before = {1: 100, 2: 5_000}
    after = {1: 1_000_100, 2: 9_000, 3: 2_000_000}  # 3 was born in between
    assert waited_s(before, after, {1, 3}) == pytest.approx(3e-3)
    assert waited_s(before, after, {2, 4}) == pytest.approx(4e-6)  # 4 has gone: nothing read
    assert waited_s({}, {}, {1}) == 0.0
