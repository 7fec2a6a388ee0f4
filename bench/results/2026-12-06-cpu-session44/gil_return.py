"""How long a single-pass AdamW loop call (``HostLoops.adamw``, the GIL released inside) takes to
return beyond its loop, on a worker thread, while another thread runs: nothing, sleeps, pure
Python (holds the GIL until CPython's switch interval asks for it), or small torch ops (each
lets the GIL go). 1 M parameters a call on one loop thread; 200 timed calls each. Run from the
repository root with OMP_NUM_THREADS=1 (two cores: the loop on one, the other thread on the other)."""
import statistics as st
import sys
import threading
import time

import torch

from strategies.memferry.host_loops import host_loops

torch.set_num_threads(1)
loops = host_loops()
n = 1 << 20
master, exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n)
grad, work = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)


def call() -> tuple[float, float]:
    """(the loop's seconds, the call's seconds beyond them)"""
    t0 = time.perf_counter()
    loop = loops.adamw(master, grad, exp_avg, exp_avg_sq, work, grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.999,
                       bias_correction2_sqrt=1.0, eps=1e-8, step_size=1e-3, threads=1)
    return loop, time.perf_counter() - t0 - loop


def load(kind: str, stop: threading.Event) -> None:
    a = torch.zeros(64)
    while not stop.is_set():
        if kind == "python":
            x = 0
            for i in range(1000):
                x += i
        elif kind == "torch ops":
            for _ in range(50):
                a.add_(1.0)
        else:
            time.sleep(0.001)


for kind, switch in [("none", None), ("sleeps", None), ("torch ops", None), ("python", None), ("python", 0.0005)]:
    if switch is not None:
        sys.setswitchinterval(switch)
    stop, res = threading.Event(), []
    other = threading.Thread(target=load, args=(kind, stop)) if kind != "none" else None
    if other:
        other.start()
    worker = threading.Thread(target=lambda: [call() for _ in range(20)] + [res.append(call()) for _ in range(200)])
    worker.start()
    worker.join()
    stop.set()
    if other:
        other.join()
    sys.setswitchinterval(0.005)
    beyond = sorted(r[1] * 1e6 for r in res)
    print(f"other thread: {kind:9s} switch interval {1e3 * (switch or 0.005):.1f} ms | loop {st.mean(r[0] for r in res) * 1e3:.2f} ms,"
          f" beyond it: median {st.median(beyond):7.1f} us, mean {st.mean(beyond):7.1f}, p90 {beyond[179]:7.1f}")
