"""Diagnostic: a linear layer whose weight lives in pinned host memory, on one CUDA GPU.

For W [n, n] (bf16, pinned, from the backend's host arena) and each batch M it measures, in
milliseconds per call (median, each call timed alone between two synchronisations):

forward
    ``resident``     F.linear with W already on the device (the floor: no link traffic);
    ``copy_gemm``    copy W host->device, then F.linear (the weight's size in device memory);
    ``dha``          cuBLAS reading W in place through ``backend.device_view`` (re-reads W per M-tile);
    ``host_linear``  strategies.memferry.dha_linear.host_linear, mode auto (DHA at M <= 64, else
                     the two-slot ring), and ``stream`` (the ring forced at every M);
weight gradient (dW = dY^T X, [n, n] into pinned host memory)
    ``dw_mm_copy``   mm on the device, then copy to host;
    ``dw_dha``       mm with ``out=device_view(host)`` (the GEMM writes host memory);
forward + backward (dX and dW into host memory)
    ``fb_copy``      copy W in, F.linear, autograd, copy W in again for dX (as an offloading
                     system would that frees W between passes), dW copied home;
    ``fb_host``      host_linear with ``grad_out`` and ``grad_write="dha"`` (dX by the ring, dW by DHA write);
    ``fb_host_ring`` the same with ``grad_write="ring"`` (dW through device slots and a copy stream;
                     what ``"auto"`` does where the weight streams).

With ``--host-load`` a thread streams host memory the whole time (a triad over three 512 MiB
fp32 arrays, as a host optimizer does in a starved step) and reports the rate it kept: does the
ring keep its link rate beside the host optimizer it meets in training?

Also: the link rate of a plain 128 MB copy each way, a chunk-size sweep of the ring at one M,
whether the link carries both directions at once (copy in beside copy out, copy in beside a
DHA-writing GEMM), and host_linear's bf16 error against F.linear on the same data. Prints a table and one JSON
line starting ``{"diag": "dha_linear"``. Runs in well under a minute on an H200.

    XPU_BACKEND=cuda python3 bench/scripts/diag_dha_linear.py [--n 8192] [--ms 64,256,1024,4096,16384] [--host-load]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run from anywhere

import torch
import torch.nn.functional as F

import xpu
from strategies.memferry.dha_linear import host_linear


def timed(fn, budget_s: float = 0.25, min_iters: int = 3, max_iters: int = 30) -> float:
    """Median milliseconds of ``fn`` (one warm-up call first)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - t0 < budget_s):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class HostLoad:
    """A thread running a triad over host arrays until stopped (a host optimizer's memory traffic)."""

    def __init__(self, nbytes: int = 512 << 20) -> None:
        n = nbytes // 4
        self.a, self.b, self.c = torch.empty(n), torch.ones(n), torch.ones(n)
        self.passes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            torch.add(self.b, self.c, alpha=0.5, out=self.a)  # reads 2 arrays, writes 1
            self.passes += 1

    def start(self) -> "HostLoad":
        """Begin the traffic (returns this load)."""
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the traffic; ``GBps`` is then what it kept up."""
        self._stop.set()
        self._thread.join()
        self.GBps = self.passes * 3 * self.a.numel() * 4 / (time.perf_counter() - self._t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192, help="weight is n x n")
    ap.add_argument("--ms", default="64,256,1024,4096,16384", help="batch sizes M (rows of X)")
    ap.add_argument("--sweep-m", type=int, default=4096, help="M of the chunk-size sweep")
    ap.add_argument("--host-load", action="store_true", help="time everything beside a thread streaming host memory")
    args = ap.parse_args()
    load = HostLoad().start() if args.host_load else None
    t_start = time.perf_counter()
    b = xpu.get_backend()
    if b.device_type != "cuda":
        raise SystemExit(f"this diagnostic needs the cuda backend, got '{b.name}' (set XPU_BACKEND=cuda)")
    n, dtype, dev = args.n, torch.bfloat16, 0
    ms = [int(m) for m in args.ms.split(",")]
    wbytes = n * n * 2
    torch.manual_seed(0)
    w_host = b.host_arena.empty((n, n), dtype)
    w_host.copy_(torch.randn(n, n, dtype=dtype) * 0.02)
    g_host = b.host_arena.empty((n, n), dtype)
    w_view, g_view = b.device_view(w_host, dev), b.device_view(g_host, dev)
    w_dev = torch.empty(n, n, dtype=dtype, device="cuda")

    h2d_ms = timed(lambda: w_dev.copy_(w_host, non_blocking=True))
    d2h_ms = timed(lambda: g_host.copy_(w_dev, non_blocking=True))
    link = {"h2d_GBps": wbytes / h2d_ms / 1e6, "d2h_GBps": wbytes / d2h_ms / 1e6}
    print(f"W {n}x{n} bf16 = {wbytes / 2**20:.0f} MiB; copy h2d {h2d_ms:.2f} ms ({link['h2d_GBps']:.1f} GB/s), "
          f"d2h {d2h_ms:.2f} ms ({link['d2h_GBps']:.1f} GB/s)")

    rows = []
    for m in ms:
        x = torch.randn(m, n, dtype=dtype, device="cuda")
        dy = torch.randn(m, n, dtype=dtype, device="cuda")
        w_dev.copy_(w_host)
        r = {"M": m}
        r["resident_ms"] = timed(lambda: F.linear(x, w_dev))

        def copy_gemm():
            w_dev.copy_(w_host, non_blocking=True)
            return F.linear(x, w_dev)

        r["copy_gemm_ms"] = timed(copy_gemm)
        r["dha_ms"] = timed(lambda: F.linear(x, w_view), budget_s=0.1)
        r["host_linear_ms"] = timed(lambda: host_linear(x, w_host, None, b, dev))
        r["stream_ms"] = timed(lambda: host_linear(x, w_host, None, b, dev, mode="stream"))

        def dw_mm_copy():
            g = torch.mm(dy.t(), x)
            g_host.copy_(g, non_blocking=True)

        r["dw_mm_copy_ms"] = timed(dw_mm_copy)
        r["dw_dha_ms"] = timed(lambda: torch.mm(dy.t(), x, out=g_view))

        xg = x.detach().requires_grad_()

        def fb_copy():
            wd = torch.empty(n, n, dtype=dtype, device="cuda")
            wd.copy_(w_host, non_blocking=True)
            y = F.linear(xg, wd)
            dx = torch.mm(dy, wd.copy_(w_host, non_blocking=True))  # W freed after forward: fetched again
            g = torch.mm(dy.t(), xg.detach())
            g_host.copy_(g, non_blocking=True)
            return y, dx

        def fb_host(grad_write: str = "dha"):
            host_linear(xg, w_host, None, b, dev, g_host, grad_write=grad_write).backward(dy)

        r["fb_copy_ms"] = timed(fb_copy)
        r["fb_host_ms"] = timed(fb_host)
        r["fb_host_ring_ms"] = timed(lambda: fb_host("ring"))

        # bf16 error against F.linear on the same data (forward; dX from the streamed backward).
        xg.grad = None
        y = host_linear(xg, w_host, None, b, dev, g_host)
        y.backward(dy)
        torch.cuda.synchronize()
        y_ref = F.linear(x, w_dev)
        dx_ref = torch.mm(dy, w_dev)
        dw_ref = torch.mm(dy.t(), x).cpu()
        r["y_rel_err"] = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        r["dx_rel_err"] = ((xg.grad.float() - dx_ref.float()).norm() / dx_ref.float().norm()).item()
        r["dw_rel_err"] = ((g_host.float() - dw_ref.float()).norm() / dw_ref.float().norm()).item()
        rows.append(r)

    sweep = {}
    x = torch.randn(args.sweep_m, n, dtype=dtype, device="cuda")
    for mb in (2, 4, 8, 16, 32, 64):
        sweep[mb] = timed(lambda: host_linear(x, w_host, None, b, dev, mode="stream", chunk_bytes=mb << 20))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    host_linear(x, w_host, None, b, dev, mode="stream")
    torch.cuda.synchronize()
    stream_peak = torch.cuda.max_memory_allocated() - base

    # Does the link carry both directions at once? (backward wants weight in, gradient out.)
    dy = torch.randn_like(x)
    w_dev2 = torch.randn_like(w_dev)
    side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()
    ops = {"h2d_copy": lambda: w_dev.copy_(w_host, non_blocking=True),
           "d2h_copy": lambda: g_host.copy_(w_dev2, non_blocking=True),
           "dha_write": lambda: torch.mm(dy.t(), x, out=g_view)}

    def together(a: str, c: str):
        def run() -> None:
            cur = torch.cuda.current_stream()
            side_a.wait_stream(cur)
            side_b.wait_stream(cur)
            with torch.cuda.stream(side_a):
                ops[a]()
            with torch.cuda.stream(side_b):
                ops[c]()
            cur.wait_stream(side_a)
            cur.wait_stream(side_b)
        return run

    duplex = {k: timed(f) for k, f in ops.items()}
    duplex["h2d_copy+d2h_copy"] = timed(together("h2d_copy", "d2h_copy"))
    duplex["h2d_copy+dha_write"] = timed(together("h2d_copy", "dha_write"))

    cols = ["resident_ms", "copy_gemm_ms", "dha_ms", "host_linear_ms", "stream_ms", "dw_mm_copy_ms", "dw_dha_ms",
            "fb_copy_ms", "fb_host_ms", "fb_host_ring_ms"]
    print(f"\n{'M':>6} " + " ".join(f"{c[:-3]:>12}" for c in cols) + "   link GB/s (host_linear fwd)")
    for r in rows:
        print(f"{r['M']:>6} " + " ".join(f"{r[c]:>12.3f}" for c in cols) + f"   {wbytes / r['host_linear_ms'] / 1e6:>6.1f}")
    print("\nbf16 relative error (norm) of host_linear vs F.linear: "
          + ", ".join(f"M={r['M']}: y {r['y_rel_err']:.1e} dX {r['dx_rel_err']:.1e} dW {r['dw_rel_err']:.1e}" for r in rows))
    print(f"ring chunk sweep at M={args.sweep_m} (ms): " + ", ".join(f"{k} MiB {v:.3f}" for k, v in sweep.items()))
    print(f"ring forward peak device memory at M={args.sweep_m}: {stream_peak / 2**20:.1f} MiB "
          f"(y is {args.sweep_m * n * 2 / 2**20:.0f} MiB, W {wbytes / 2**20:.0f} MiB)")
    print("duplex (ms, M=%d for the DHA write): " % args.sweep_m + ", ".join(f"{k} {v:.2f}" for k, v in duplex.items()))
    if load is not None:
        load.stop()
        print(f"host load: a triad thread kept {load.GBps:.1f} GB/s of host memory traffic throughout")
    out = {"diag": "dha_linear", "device": torch.cuda.get_device_name(0), "n": n, "dtype": "bf16", "link": link,
           "host_load_GBps": load.GBps if load is not None else None,
           "rows": rows, "chunk_sweep_ms": sweep, "sweep_m": args.sweep_m, "stream_peak_bytes": stream_peak, "duplex_ms": duplex,
           "wall_s": time.perf_counter() - t_start}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
