"""ns per element of the host optimizer's kernels and of gradient accumulation, on this host.

    python3 bench/scripts/diag_host_kernel.py [--numel 33554432] [--repeats 5] [--threads N]

Times, on one flat unit of ``--numel`` bf16 parameters (fp32 master and moments), in a worker
thread as HostOptimizer runs them: the ``torch`` kernel (upcast, fused AdamW, write-back),
the ``single-pass`` kernel (the C loop of host_loops.c), the earlier dynamic-size
single-pass build (``dynamic=True``, compiled in the main thread), each alone and with a busy
Python main thread; and the fp32 accumulation of a bf16 micro-batch gradient: eager
``acc.add_(bf16)`` (what HostOptimizer did) against ``kernel.accumulate``. Prints JSON lines.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time

import torch

from strategies.memferry.config import AdamW
from strategies.memferry.host_kernel import SinglePassKernel, TorchKernel
from strategies.memferry.shadow import UnitShadow


def _old_single_pass(master, grad_low, exp_avg, exp_avg_sq, work, scalars, beta1, beta2, eps):
    g = grad_low.float() * scalars[0]
    master.mul_(scalars[1])
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / scalars[3] + eps
    master.sub_(exp_avg / denom * scalars[2])
    work.copy_(master)


def timed(fn, repeats: int, threads: int | None, busy: bool) -> float:
    """Median seconds of ``fn`` in a worker thread (after one warm-up call)."""
    out: list[float] = []
    stop = threading.Event()

    def work() -> None:
        if threads:
            torch.set_num_threads(threads)
        fn()
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        stop.set()

    t = threading.Thread(target=work)
    t.start()
    while busy and not stop.is_set():
        sum(i * i for i in range(2000))  # the training thread: Python busy launching kernels
    t.join()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=32 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    n = args.numel
    cfg = AdamW(lr=1e-4, weight_decay=0.01, host_threads=args.threads)

    def shadow() -> UnitShadow:
        master = torch.randn(n)
        stage = torch.randn(n).to(torch.bfloat16)
        return UnitShadow(None, master.to(torch.bfloat16), master, torch.zeros(n), torch.zeros(n), stage, stage, None, [])

    s = shadow()
    t0 = time.perf_counter()
    kernels = {"torch": TorchKernel(cfg, [s]), "single-pass": SinglePassKernel(cfg, [s])}
    print(json.dumps({"compile_s": round(time.perf_counter() - t0, 2), "threads": torch.get_num_threads()}))
    old = torch.compile(_old_single_pass, dynamic=True, fullgraph=True)
    sc = torch.tensor([1.0, 1.0 - 1e-6, 1e-4, math.sqrt(1e-3)])
    runs = {name: (lambda k=k: k.apply(s, 1.0)) for name, k in kernels.items()}
    runs["single-pass-dynamic (old)"] = lambda: old(s.master, s.grad_stage, s.exp_avg, s.exp_avg_sq, s.work, sc,
                                                    0.9, 0.999, 1e-8)
    for name, fn in runs.items():
        for busy in (False, True):
            sec = timed(fn, args.repeats, args.threads, busy)
            print(json.dumps({"kernel": name, "busy_main_thread": busy, "ns_per_param": round(sec / n * 1e9, 3)}))
    acc, g = torch.zeros(n), torch.randn(n).to(torch.bfloat16)
    accs = {"eager acc.add_(bf16) (before)": lambda: acc.add_(g),
            "torch kernel accumulate (chunked scratch)": lambda: kernels["torch"].accumulate(acc, g),
            "single-pass accumulate (compiled)": lambda: kernels["single-pass"].accumulate(acc, g)}
    for name, fn in accs.items():
        sec = timed(fn, args.repeats, args.threads, False)
        print(json.dumps({"accumulate": name, "ns_per_element": round(sec / n * 1e9, 3)}))


if __name__ == "__main__":
    main()
