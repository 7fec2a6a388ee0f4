"""Host memory of this process and its descendants, and a sampling thread with a cap (the bench worker's)."""
from __future__ import annotations

import os
import resource
import sys
import threading
from typing import Callable

__all__ = ["host_bytes_now", "HostMemoryMonitor", "ru_maxrss_bytes"]


def _status_kb(pid: int | str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids.extend(int(x) for x in fh.read().split())
    except OSError:
        pass
    return kids


def host_bytes_now() -> int:
    """Host memory held now by this process and its descendants (Linux; else this process's peak).

    This process's resident set plus, for each descendant (e.g. ZenFlow's optimizer process),
    its private and file-backed resident pages: shared memory it maps from us is already in
    our resident set, so it is not counted twice.
    """
    me = _status_kb("self", ("VmRSS",)).get("VmRSS")
    if me is None:
        return ru_maxrss_bytes()
    total, stack = me, _children(os.getpid())
    while stack:
        pid = stack.pop()
        s = _status_kb(pid, ("RssAnon", "RssFile", "VmRSS"))
        total += s.get("RssAnon", 0) + s.get("RssFile", 0) if "RssAnon" in s else s.get("VmRSS", 0)
        stack.extend(_children(pid))
    return total


def ru_maxrss_bytes() -> int:
    """This process's peak resident set in bytes."""
    # ru_maxrss is KiB on Linux, bytes on macOS.
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


class HostMemoryMonitor:
    """Samples host memory in a thread; the peak is the max of samples and ``ru_maxrss``.

    With ``cap_bytes`` and ``on_exceed``, calls ``on_exceed(bytes)`` once when a sample goes
    past the cap (the worker process uses it to report "oom" and exit at once, as a smaller
    host would have).
    """

    def __init__(self, cap_bytes: int | None = None, on_exceed: Callable[[int], None] | None = None,
                 interval_s: float = 0.2) -> None:
        self.cap, self.on_exceed, self.interval = cap_bytes, on_exceed, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-host-mem", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        """Take one sample now; return the peak so far."""
        now = host_bytes_now()
        self.peak = max(self.peak, now)
        if self.cap is not None and now > self.cap and self.on_exceed is not None:
            callback, self.on_exceed = self.on_exceed, None
            callback(now)
        return self.peak

    def start(self) -> "HostMemoryMonitor":
        """Start sampling."""
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; return the peak in bytes (including this process's ``ru_maxrss``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.sample()
        return max(self.peak, ru_maxrss_bytes())
