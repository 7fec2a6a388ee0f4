"""Diagnostic: xpu.triton_dha's in-place kernels against cuBLAS over the same host memory, on one CUDA GPU.

W [n, n] bf16 in pinned host memory (the backend's arena), seen through ``device_view``. For each
M, in ms per call (median, each call between two synchronisations), and as a share of the
measured copy rate in that direction:

``fwd``  y = x @ W^T reading W in place: ``F.linear`` over the view (cuBLAS) vs ``mm_read_once``;
``dx``   dX = dY @ W reading W in place: ``torch.mm`` vs ``mm_read_once``;
``dw``   dW = dY^T @ X written into host memory in place: ``torch.mm(out=view)`` vs ``mm_write_once``.

Reads only at M <= MAX_ROWS (one Triton program holds every row); writes at every M. Also the
bf16 relative error of each Triton result against cuBLAS on the device-resident weight.

    XPU_BACKEND=cuda python3 bench/scripts/diag_dha_triton.py [--n 8192] [--ms 1,16,64,128,1024,4096,8192]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import xpu
from xpu import triton_dha


def timed(fn, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ms", default="1,16,64,128,1024,4096,8192")
    args = ap.parse_args()
    b = xpu.get_backend()
    if b.device_type != "cuda" or not b.caps.triton:
        raise SystemExit(f"needs the cuda backend with Triton (backend '{b.name}', caps.triton {b.caps.triton})")
    n, dt = args.n, torch.bfloat16
    w_host, g_host = b.host_arena.empty((n, n), dt), b.host_arena.empty((n, n), dt)
    w_host.copy_(torch.randn(n, n, dtype=dt) * 0.02)
    w_view, g_view = b.device_view(w_host, 0), b.device_view(g_host, 0)
    w_dev = w_host.cuda()
    nbytes = n * n * 2
    h2d = nbytes / timed(lambda: w_dev.copy_(w_host, non_blocking=True)) / 1e6
    d2h = nbytes / timed(lambda: g_host.copy_(w_dev, non_blocking=True)) / 1e6
    print(f"W {n}x{n} bf16, {nbytes / 2**20:.0f} MiB; copy h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    rows = []
    for m in (int(s) for s in args.ms.split(",")):
        x, dy = torch.randn(m, n, dtype=dt, device="cuda"), torch.randn(m, n, dtype=dt, device="cuda")
        r = {"M": m}
        if m <= triton_dha.MAX_ROWS:
            r["fwd_cublas"] = timed(lambda: F.linear(x, w_view))
            r["fwd_triton"] = timed(lambda: triton_dha.mm_read_once(x, w_view.t()))
            r["dx_cublas"] = timed(lambda: torch.mm(dy, w_view))
            r["dx_triton"] = timed(lambda: triton_dha.mm_read_once(dy, w_view))
            r["fwd_err"] = rel(triton_dha.mm_read_once(x, w_view.t()), F.linear(x, w_dev))
            r["dx_err"] = rel(triton_dha.mm_read_once(dy, w_view), torch.mm(dy, w_dev))
        r["dw_cublas"] = timed(lambda: torch.mm(dy.t(), x, out=g_view))
        r["dw_triton"] = timed(lambda: triton_dha.mm_write_once(dy.t(), x, g_view))
        r["dw_device_gemm"] = timed(lambda: torch.mm(dy.t(), x))
        torch.cuda.synchronize()
        r["dw_err"] = rel(g_host.cuda(), torch.mm(dy.t(), x))
        rows.append(r)
    print(f"\n{'M':>6} {'fwd cuBLAS':>12} {'fwd Triton':>12} {'dX cuBLAS':>12} {'dX Triton':>12} "
          f"{'dW cuBLAS':>12} {'dW Triton':>12} {'dW on device':>12}   (ms; % of the copy rate)")
    for r in rows:
        def cell(key: str, rate: float) -> str:
            return f"{r[key]:6.3f} ({nbytes / r[key] / 1e6 / rate * 100:3.0f}%)" if key in r else f"{'-':>12}"
        print(f"{r['M']:>6} {cell('fwd_cublas', h2d)} {cell('fwd_triton', h2d)} {cell('dx_cublas', h2d)} "
              f"{cell('dx_triton', h2d)} {cell('dw_cublas', d2h)} {cell('dw_triton', d2h)} {r['dw_device_gemm']:12.3f}")
    print("bf16 relative error of Triton vs cuBLAS on the resident weight: " + ", ".join(
        f"M={r['M']}: " + " ".join(f"{k[:-4]} {r[k]:.1e}" for k in ("fwd_err", "dx_err", "dw_err") if k in r) for r in rows))
    print(json.dumps({"diag": "dha_triton", "device": torch.cuda.get_device_name(0), "n": n,
                      "link": {"h2d_GBps": h2d, "d2h_GBps": d2h}, "rows": rows}))


if __name__ == "__main__":
    main()
