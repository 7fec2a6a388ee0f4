"""The training thread's time to send one block's gradients home (``GradientPost.send``).

Host-summing plans spend 99-121 ms a step in ``send`` on the H200 (``grad_post_ms_per_step``,
session 24), about 0.6 ms per block and micro-batch, where a block's backward takes 3.3 ms on
the device. This times ``send`` alone, with the device kept busy so that every copy only
queues (the thread's own cost, not the copies'), in three forms and three host conditions:

forms:
  post     the engine's ``GradientPost.send`` (one ``Backend.copy`` and ``keep_alive`` per tensor)
  foreach  the same copies as one ``torch._foreach_copy_`` in one stream context
  flat     one copy of a single flat gradient buffer (what a unit whose gradients live in one
           device buffer would send)
  sum32    ``GradientPost.send`` of one fp32 tensor of the block's size (a device-summed unit's sum)
  post@autograd  ``post`` from a backward hook, on autograd's device thread, where a step sends
host:
  idle     nothing else runs
  sums@T   a thread sums bf16 gradients into fp32 with the host kernel on T OpenMP threads (C,
           GIL released), as the host optimizer's worker does under accumulation: with T at the
           core count the team and the training thread share every core
  python   a thread runs pure Python (holds the GIL between switch intervals); a tenth of the sends
  spin     a thread waits on device events in a loop, as the host optimizer's worker waits for a
           landing (``Event.synchronize``: the runtime spins in its default mode)
  sleep    the same with blocking-sync events (the waiting thread sleeps; in steps:
           ``AdamW(landing_wait="sleep")``, bench option ``landing_wait: sleep``)
In a real step a send of one micro-batch took 0.45-0.60 ms of the training thread, all of it CPU
time (``GradientPost.parts``, H200, 2026-12-04), against 0.15 ms here for the same call idle:
the conditions above are the candidates for the difference.

Usage: XPU_BACKEND=cuda python3 bench/scripts/diag_grad_post.py [--hidden 2048] [--sends 200]
       [--sum-threads 16,14] [--switch-ms MS]
  (on the device: bash bench/scripts/gpu_diag.sh grad_post)
Prints microseconds per send (median and 90th percentile) for each form and condition, and the
training thread's wait for a core per send (schedstat's run delay, which includes the occupying
kernels' launches: compare conditions, not absolute values).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

import xpu
from bench.grad_sends import Submitted, block_gradients
from bench.thread_waits import run_delays, waited_s
from strategies.memferry.grad_post import GradientPost
from strategies.memferry.host_loops import host_loops
from xpu.timing import occupy


def _busy(kind: str, stop: threading.Event) -> threading.Thread | None:
    if kind == "idle":
        return None
    if kind.startswith("sums@"):
        loops, n = host_loops(), 32 << 20
        acc, g = torch.zeros(n), torch.randn(n).to(torch.bfloat16)
        threads = int(kind.split("@")[1])

        def run() -> None:
            while not stop.is_set():
                loops.accumulate(acc, g, threads)
    elif kind in ("spin", "sleep"):
        b = xpu.get_backend()
        side = b.stream(0)

        def run() -> None:
            while not stop.is_set():
                occupy(b, 0, side, 0.002)
                done = b.event(blocking=kind == "sleep")
                done.record(side)
                done.synchronize()
    else:
        def run() -> None:
            x = 0
            while not stop.is_set():
                for i in range(10_000):
                    x += i * i
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sends", type=int, default=200)
    ap.add_argument("--sum-threads", default=f"{torch.get_num_threads()},{max(1, torch.get_num_threads() - 2)}",
                    help="OpenMP team sizes of the summing thread, comma-separated")
    ap.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval for the run (default 5 ms)")
    a = ap.parse_args()
    if a.switch_ms is not None:
        sys.setswitchinterval(a.switch_ms / 1e3)
    b = xpu.get_backend()
    dev = b.device(0)
    grads = block_gradients(b, a.hidden, a.heads)
    sources, targets, host, numel = grads.sources, grads.targets, grads.host, grads.numel
    flat_src = torch.randn(numel, dtype=torch.bfloat16, device=dev)
    d2h = b.stream(0)
    opt = Submitted()
    post = GradientPost(b, 0, d2h, opt)  # type: ignore[arg-type]

    def send_post() -> None:
        post.send(0, sources, targets, final=False)

    def send_foreach() -> None:
        computed = b.event()
        computed.record(b.current_stream(0))
        d2h.wait_event(computed)
        with b.use_stream(d2h):
            torch._foreach_copy_(targets, sources, non_blocking=True)
            for g in sources:
                b.keep_alive(g, d2h)
            landed = b.event()
            landed.record(d2h)
        opt.submit(0, landed.synchronize, final=False, landed=landed.query)

    def send_flat() -> None:
        computed = b.event()
        computed.record(b.current_stream(0))
        d2h.wait_event(computed)
        with b.use_stream(d2h):
            host.copy_(flat_src, non_blocking=True)
            b.keep_alive(flat_src, d2h)
            landed = b.event()
            landed.record(d2h)
        opt.submit(0, landed.synchronize, final=False, landed=landed.query)

    sum_src = torch.randn(numel, dtype=torch.float32, device=dev)
    sum_host = b.alloc_pinned(numel * 4).view(torch.float32)

    def send_sum() -> None:  # a device-summed unit's fp32 sum: one tensor, through GradientPost
        post.send(0, [sum_src], [sum_host], final=True, summed=True)

    leaf = torch.zeros(1, device=dev, requires_grad=True)

    def send_in_backward() -> float:  # as in a step: GradientPost.send from autograd's device thread
        took: list[float] = []

        def hook(grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            send_post()
            took.append(time.perf_counter() - t0)

        out = leaf * 2.0
        out.register_hook(hook)
        out.sum().backward()
        return took[0]

    forms = {"post": send_post, "foreach": send_foreach, "flat": send_flat, "sum32": send_sum,
             "post@autograd": send_in_backward}
    print(f"block of {len(sources)} tensors, {numel:,} parameters ({numel * 2 / 2**20:.0f} MiB bf16); "
          f"{a.sends} sends per cell; switch interval {1e3 * sys.getswitchinterval():.1f} ms")
    rows = []
    for cond in ("idle", *(f"sums@{t}" for t in a.sum_threads.split(",")), "spin", "sleep", "python"):
        sends = a.sends // 10 if cond == "python" else a.sends  # each takes ~0.3 s there
        stop = threading.Event()
        worker = _busy(cond, stop)
        try:
            for name, fn in forms.items():
                fn()  # warm
                b.synchronize(0)
                times = []
                before, me = run_delays(), {threading.get_native_id()}  # this thread's waits for a core
                for k in range(sends):
                    if k % 20 == 0:  # the device busy ahead of the next 20 sends' copies
                        b.synchronize(0)
                        occupy(b, 0, b.current_stream(0), 0.05)
                    t0 = time.perf_counter()
                    inner = fn()  # a form that times its own send returns it
                    times.append(inner if inner is not None else time.perf_counter() - t0)
                waited = waited_s(before, run_delays(), me) * 1e9
                b.synchronize(0)
                opt.drain()
                times.sort()
                rows.append((cond, name, statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6,
                             waited / 1e3 / sends))
        finally:
            stop.set()
            if worker is not None:
                worker.join()
    print("| host | form | us per send (median) | p90 | us waiting for a core per send |")
    print("|---|---|---:|---:|---:|")
    for cond, name, med, p90, wait in rows:
        print(f"| {cond} | {name} | {med:.0f} | {p90:.0f} | {wait:.0f} |")


if __name__ == "__main__":
    main()
