"""A worker thread calling the single-pass AdamW loop in pieces (ctypes lets go of the GIL inside
each call) beside another thread, at CPython's 5 ms switch interval and at 0.5 ms. 'timed C' is
the calls as the worker clocks them, taking the GIL back included.

    gil_worker.py pure     640 pieces; alone, then beside a thread running pure Python
    gil_worker.py ops K    80 pieces; beside a thread issuing small torch ops (each lets go of
                           the GIL), alone ('ops') or with a K-entry dict between ops ('ops+py')
"""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from strategies.memferry.host_loops import host_loops  # noqa: E402

torch.set_num_threads(1)
LOOPS = host_loops()
PURE = sys.argv[1] == "pure"
K = 0 if PURE else int(sys.argv[2])
N, PIECE, UNITS = 1 << 22, (1 << 18) if PURE else (1 << 20), 40 if PURE else 20
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
            if PURE:
                _ = {i: i for i in range(50)}  # a little Python between pieces, as the worker's bookkeeping
    res.append((time.perf_counter() - start, called))


def pure_python(stop):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def issuing(stop, python):
    a = torch.randn(32, 32)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a * 0.01)
            if python:
                _ = {i: i * i for i in range(K)}


CASES = ((("alone", None, 0.005), ("busy main", (pure_python,), 0.005), ("busy, switch 0.5ms", (pure_python,), 0.0005))
         if PURE else
         (("alone", None, 0.005), ("ops, 5 ms", (issuing, False), 0.005), ("ops, 0.5 ms", (issuing, False), 0.0005),
          ("ops+py, 5 ms", (issuing, True), 0.005), ("ops+py, 0.5 ms", (issuing, True), 0.0005)))
for label, beside, interval in CASES:
    sys.setswitchinterval(interval)
    res, stop = [], threading.Event()
    w = threading.Thread(target=worker, args=(res,))
    w.start()
    other = threading.Thread(target=beside[0], args=(stop, *beside[1:])) if beside else None
    if other:
        other.start()
    w.join()
    stop.set()
    if other:
        other.join()
    wall, called = res[0]
    print(f"{label:22s} wall {wall * 1e3:7.1f} ms  timed C {called * 1e3:7.1f} ms  outside {(wall - called) * 1e3:6.1f} ms  "
          f"pieces {UNITS * N // PIECE}")
