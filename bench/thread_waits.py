"""How long threads of this process waited for a core (Linux schedstat's run delay).

A thread that issues device work and shares the host's cores with a busy optimizer team gets
time-sliced: the device then idles while the thread is runnable but not running. Linux counts
that wait per thread (``/proc/self/task/TID/schedstat``, second field, nanoseconds); elsewhere
nothing is counted and the readings are empty.
"""
from __future__ import annotations

import os

__all__ = ["run_delays", "waited_s"]


def run_delays() -> dict[int, int]:
    """Nanoseconds each thread of this process (by native id) has waited for a core so far."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def waited_s(before: dict[int, int], after: dict[int, int], threads: set[int]) -> float:
    """Seconds ``threads`` waited for a core between two :func:`run_delays` readings (a thread
    born in between counts from its start)."""
    return sum(after[t] - before.get(t, 0) for t in threads if t in after) / 1e9
