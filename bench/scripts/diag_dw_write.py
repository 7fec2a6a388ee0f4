"""Diagnostic: how close a DHA weight-gradient write (``dW = dY^T X`` written by the GEMM
straight into pinned host memory through ``backend.device_view``) comes to the device->host
line rate, on one CUDA GPU.

For W [n, n] bf16 (128 MiB at n = 8192) and each batch M, milliseconds per call (median):
    ``d2h_copy``      a plain copy of n x n bf16 from device to pinned host memory (the line rate);
    ``dw_dha``        one GEMM with ``out=`` the host view (what ``host_linear`` does per chunk);
    ``dw_dha_rowsK``  the same GEMM split into K row blocks alternating over two streams, so one
                      block's compute overlaps another's writes over the link;
    ``dw_mm_copy``    GEMM into device memory, then copy home (the other gradient destination);
    ``dw_ringK``      that, in K row blocks through two device slots, each block's copy home (on
                      a copy stream) overlapping the next block's GEMM (host_linear's no-DHA path).
Each as a rate, dW bytes / time, and as a share of the D2H line rate. Also whether
``torch.mm(..., out_dtype=torch.float32)`` (bf16 inputs, fp32 result) exists here, for
accumulating host_linear's dX chunks in fp32. Prints a table and one JSON line starting
``{"diag": "dw_write"``.

    XPU_BACKEND=cuda python3 bench/scripts/diag_dw_write.py [--n 8192] [--ms 1024,4096,8192]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run from anywhere

import torch

import xpu
from diag_dha_linear import timed  # this folder is on sys.path when a script here runs


def split_rows(dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor, k: int, streams: list) -> None:
    """dW = dY^T X in ``k`` row blocks, block i on ``streams[i % 2]``."""
    cur = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(cur)
    n = out.shape[0]
    step = -(-n // k)
    for i, r0 in enumerate(range(0, n, step)):
        with torch.cuda.stream(streams[i % len(streams)]):
            torch.mm(dy[:, r0:r0 + step].t(), x, out=out[r0:r0 + step])
    for s in streams:
        cur.wait_stream(s)


def ring(dy: torch.Tensor, x: torch.Tensor, out_host: torch.Tensor, k: int, slots: list, d2h: torch.cuda.Stream) -> None:
    """dW in ``k`` row blocks: GEMM into a device slot, copy home on ``d2h`` while the next computes."""
    cur = torch.cuda.current_stream()
    n = out_host.shape[0]
    step = -(-n // k)
    landed: list = [None, None]
    for i, r0 in enumerate(range(0, n, step)):
        j = i % 2
        if landed[j] is not None:
            cur.wait_event(landed[j])
        slot = slots[j][: min(step, n - r0)]
        torch.mm(dy[:, r0:r0 + step].t(), x, out=slot)
        d2h.wait_stream(cur)
        with torch.cuda.stream(d2h):
            out_host[r0:r0 + step].copy_(slot, non_blocking=True)
            landed[j] = torch.cuda.Event()
            landed[j].record(d2h)
    cur.wait_stream(d2h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ms", default="1024,4096,8192")
    args = ap.parse_args()
    b = xpu.get_backend()
    if b.device_type != "cuda":
        raise SystemExit(f"this diagnostic needs the cuda backend, got '{b.name}' (set XPU_BACKEND=cuda)")
    n, dtype, dev = args.n, torch.bfloat16, 0
    nbytes = n * n * 2
    g_host = b.host_arena.empty((n, n), dtype)
    g_view = b.device_view(g_host, dev)
    src = torch.randn(n, n, dtype=dtype, device="cuda")
    d2h_ms = timed(lambda: g_host.copy_(src, non_blocking=True))
    line = nbytes / d2h_ms / 1e6
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, n, dtype=dtype, device="cuda")
        dy = torch.randn(m, n, dtype=dtype, device="cuda")
        r = {"M": m, "resident_ms": timed(lambda: torch.mm(dy.t(), x))}
        r["dw_dha_ms"] = timed(lambda: torch.mm(dy.t(), x, out=g_view))
        for k in (4, 8, 16):
            r[f"dw_dha_rows{k}_ms"] = timed(lambda k=k: split_rows(dy, x, g_view, k, streams))

        def mm_copy() -> None:
            g_host.copy_(torch.mm(dy.t(), x), non_blocking=True)

        r["dw_mm_copy_ms"] = timed(mm_copy)
        d2h = torch.cuda.Stream()
        for k in (8, 16):
            slots = [torch.empty(-(-n // k), n, dtype=dtype, device="cuda") for _ in range(2)]
            r[f"dw_ring{k}_ms"] = timed(lambda k=k, slots=slots: ring(dy, x, g_host, k, slots, d2h))
        ref = torch.mm(dy.t(), x).cpu()
        split_rows(dy, x, g_view, 8, streams)
        torch.cuda.synchronize()
        r["rows8_matches"] = bool(torch.equal(g_host, ref))
        g_host.zero_()
        ring(dy, x, g_host, 16, slots, d2h)
        torch.cuda.synchronize()
        r["ring16_matches"] = bool(torch.equal(g_host, ref))
        rows.append(r)
    fp32 = {}
    try:
        a = torch.randn(4096, n, dtype=dtype, device="cuda")
        w = torch.randn(n, n, dtype=dtype, device="cuda")
        out = torch.mm(a, w, out_dtype=torch.float32)
        fp32 = {"supported": out.dtype == torch.float32, "bf16_ms": timed(lambda: torch.mm(a, w)),
                "fp32_out_ms": timed(lambda: torch.mm(a, w, out_dtype=torch.float32))}
    except (TypeError, RuntimeError) as exc:
        fp32 = {"supported": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

    print(f"d2h line: {d2h_ms:.3f} ms for {nbytes / 2**20:.0f} MiB = {line:.1f} GB/s")
    keys = [k for k in rows[0] if k.endswith("_ms")]
    print("     M  " + "  ".join(f"{k[:-3]:>16}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            share = "" if k == "resident_ms" else f" {nbytes / r[k] / 1e6 / line:4.0%}"
            cells.append(f"{r[k]:7.3f}{share:>9}")
        print(f"{r['M']:6d}  " + "  ".join(f"{c:>16}" for c in cells) + f"  exact: rows8 {r['rows8_matches']}, ring16 {r['ring16_matches']}")
    print("mm out_dtype=fp32:", fp32)
    print(json.dumps({"diag": "dw_write", "device": torch.cuda.get_device_name(0), "n": n, "d2h_ms": d2h_ms,
                      "d2h_GBps": line, "rows": rows, "mm_out_dtype_fp32": fp32}))


if __name__ == "__main__":
    main()
