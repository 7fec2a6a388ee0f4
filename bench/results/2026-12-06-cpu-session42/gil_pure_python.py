"""A worker thread calling the single-pass AdamW loop in 640 pieces (ctypes lets go of the GIL
inside each call), alone, beside a thread running pure Python, and the same at a 0.5 ms switch
interval: 'timed C' is the calls as the worker clocks them, GIL reacquisition included."""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from strategies.memferry.host_loops import host_loops  # noqa: E402

LOOPS = host_loops()
N, PIECE, UNITS = 1 << 22, 1 << 18, 40
master, g = torch.randn(N), torch.randn(N).bfloat16()
m, v, work = torch.zeros(N), torch.zeros(N), torch.empty(N, dtype=torch.bfloat16)


def worker(res):
    called, start = 0.0, time.perf_counter()
    for _ in range(UNITS):
        for a in range(0, N, PIECE):
            t0 = time.perf_counter()
            LOOPS.adamw(master[a:a + PIECE], (g[a:a + PIECE],), m[a:a + PIECE], v[a:a + PIECE], work[a:a + PIECE],
                        grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.999, bias_correction2_sqrt=1.0, eps=1e-8,
                        step_size=1e-3, threads=1)
            called += time.perf_counter() - t0
            _ = {i: i for i in range(50)}  # a little Python between pieces, as the worker's bookkeeping
    res.append((time.perf_counter() - start, called))


def busy(stop):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


for label, with_busy, interval in (("alone", False, 0.005), ("busy main", True, 0.005), ("busy, switch 0.5ms", True, 0.0005)):
    sys.setswitchinterval(interval)
    res, stop = [], threading.Event()
    w = threading.Thread(target=worker, args=(res,))
    w.start()
    b = threading.Thread(target=busy, args=(stop,)) if with_busy else None
    if b:
        b.start()
    w.join()
    stop.set()
    if b:
        b.join()
    wall, called = res[0]
    print(f"{label:22s} wall {wall * 1e3:7.1f} ms  timed C {called * 1e3:7.1f} ms  outside {(wall - called) * 1e3:6.1f} ms  "
          f"pieces {UNITS * N // PIECE}")
