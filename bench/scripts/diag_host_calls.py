"""Diagnostic: what one call of the host AdamW loop costs beyond its bytes, and whether an update
run in pieces (``AdamW.host_order="deadline"``) keeps the rate of a whole one.

    python3 bench/scripts/diag_host_calls.py [--threads 2,8] [--piece 8388608] [--whole 50331648]

Runs on any machine (no device). Times the C loop of ``host_loops.c`` in place on bf16 gradients
and working copy: small calls (65,536 and 1,048,576 elements: the fixed cost of a call and its
thread team), then ``--whole`` elements as one call against the same elements in ``--piece``
calls. Prints a markdown table: microseconds per call and ns per parameter.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from strategies.memferry import host_loops  # noqa: E402
from strategies.memferry.host_kernel import SinglePassKernel  # noqa: E402


def _buffers(n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16),
            torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.empty(n, dtype=torch.bfloat16))


def _timed(n: int, threads: int, piece: int, repeats: int) -> float:
    """Seconds per pass over ``n`` elements in calls of ``piece`` (best of ``repeats``)."""
    loops = host_loops.host_loops()
    p, g, m, v, w = _buffers(n)
    kw = dict(grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.99, bias_correction2_sqrt=0.5, eps=1e-8,
              step_size=1e-3, threads=threads)

    def sweep() -> None:
        for a in range(0, n, piece):
            b = min(a + piece, n)
            loops.adamw(p[a:b], g[a:b], m[a:b], v[a:b], w[a:b], **kw)

    sweep()  # warm: pages touched, team started
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sweep()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2,8", help="thread counts, comma-separated")
    ap.add_argument("--piece", type=int, default=SinglePassKernel.piece, help="elements per piece (default: the kernel's)")
    ap.add_argument("--whole", type=int, default=48 << 20, help="elements of the whole update")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs; torch {torch.__version__}")
    print("| threads | what | µs per call | ns per parameter |")
    print("|---:|---|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        for n, repeats in ((1 << 16, 400), (1 << 20, 100)):
            s = _timed(n, threads, n, repeats)
            print(f"| {threads} | one call of {n:,} | {s * 1e6:.1f} | {s / n * 1e9:.3f} |")
        whole = _timed(args.whole, threads, args.whole, 3)
        pieces = _timed(args.whole, threads, args.piece, 3)
        calls = -(-args.whole // args.piece)
        print(f"| {threads} | {args.whole:,} in one call | {whole * 1e6:.0f} | {whole / args.whole * 1e9:.3f} |")
        print(f"| {threads} | {args.whole:,} in {calls} pieces | {pieces / calls * 1e6:.0f} | "
              f"{pieces / args.whole * 1e9:.3f} |")


if __name__ == "__main__":
    main()
