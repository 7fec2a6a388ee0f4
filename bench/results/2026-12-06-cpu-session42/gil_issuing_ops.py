"""A worker thread calling the single-pass AdamW loop in 80 pieces beside a thread issuing small
torch ops (each lets go of the GIL), alone ('ops') or with a Python stretch of a K-entry dict
between ops ('ops+py'), at CPython's 5 ms switch interval and at 0.5 ms. Usage: gil_issuing_ops.py K"""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from strategies.memferry.host_loops import host_loops  # noqa: E402

torch.set_num_threads(1)
LOOPS = host_loops()
N, PIECE, UNITS, K = 1 << 22, 1 << 20, 20, int(sys.argv[1])
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
    res.append((time.perf_counter() - start, called))


def issuing(stop, python):
    a = torch.randn(32, 32)
    while not stop.is_set():
        for _ in range(20):
            a = torch.tanh(a @ a * 0.01)
            if python:
                _ = {i: i * i for i in range(K)}


for label, mode, interval in (("alone", None, 0.005), ("ops, 5 ms", False, 0.005), ("ops, 0.5 ms", False, 0.0005),
                              ("ops+py, 5 ms", True, 0.005), ("ops+py, 0.5 ms", True, 0.0005)):
    sys.setswitchinterval(interval)
    res, stop = [], threading.Event()
    w = threading.Thread(target=worker, args=(res,))
    w.start()
    t = threading.Thread(target=issuing, args=(stop, mode)) if mode is not None else None
    if t:
        t.start()
    w.join()
    stop.set()
    if t:
        t.join()
    wall, called = res[0]
    print(f"{label:16s} wall {wall * 1e3:7.1f} ms  timed C {called * 1e3:7.1f} ms  pieces {UNITS * N // PIECE}")
