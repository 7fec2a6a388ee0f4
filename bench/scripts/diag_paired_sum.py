"""Summing accumulated micro-batches on the host: two passes of ``acc += g`` against one pass
of ``acc = (acc + g0) + g1`` (``host_loops.accumulate_pair``, bit-equal), timed alone.

Usage: python3 bench/scripts/diag_paired_sum.py [--numel N] [--threads T] [--repeats R]
Prints the fastest of R calls (after one untimed call) of each, on an N-element fp32 sum and
two bf16 gradients, T threads (default: torch's intra-op count), with the host-memory rate
each implies (20 bytes per element for two passes, 12 for one).
"""
from __future__ import annotations

import argparse
import time

import torch

from strategies.memferry.host_loops import host_loops


def _fastest(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n, loops, t = args.numel, host_loops(), args.threads
    acc = torch.zeros(n)
    g0, g1 = torch.randn(n).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    two = _fastest(lambda: (loops.accumulate(acc, g0, t), loops.accumulate(acc, g1, t)), args.repeats)
    one = _fastest(lambda: loops.accumulate_pair(acc, g0, g1, t, False), args.repeats)
    print(f"{n} elements, {t} threads")
    print(f"two passes: {two * 1e3:.1f} ms ({20 * n / two / 1e9:.1f} GB/s)")
    print(f"one pass:   {one * 1e3:.1f} ms ({12 * n / one / 1e9:.1f} GB/s)")
    print(f"one pass is {two / one:.2f}x faster")


if __name__ == "__main__":
    main()
