"""What a profiler span, and a loop call, cost a thread beside another running pure Python: each
entry that releases the GIL waits to take it back. Microseconds per call, alone and beside a busy
Python thread (CPython's default 5 ms switch interval). Run from the repository root with
OMP_NUM_THREADS=1. ``torch.profiler.record_function`` enters through a dispatched operator, which
releases the GIL; ``xpu.spans.profiling()`` (what ``xpu.spans.span`` asks first) is a Python read
and does not."""
import ctypes
import threading
import time

import torch

from xpu.spans import profiling

stop = False


def busy() -> None:
    x = 0
    while not stop:
        x += 1


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def record_function() -> None:
    with torch.profiler.record_function("x"):
        pass


libc = ctypes.CDLL(None)
calls = {"pure Python": lambda: sum(range(10)), "a ctypes call (releases the GIL)": lambda: libc.getpid(),
         "record_function enter and exit": record_function,
         "xpu.spans.profiling()": profiling}
alone = {name: per_call_us(fn, 2000) for name, fn in calls.items()}
thread = threading.Thread(target=busy, daemon=True)
thread.start()
time.sleep(0.05)
beside = {name: per_call_us(fn, 2000) for name, fn in calls.items()}
stop = True
thread.join()
for name in calls:
    print(f"{name:34s} alone {alone[name]:7.1f} us, beside a busy Python thread {beside[name]:7.1f} us")
