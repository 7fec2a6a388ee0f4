"""Diagnostic: the host's work after a step's last micro-batch, summing the last pair into the
fp32 sum and then updating from it, against one update that adds the pair as it reads it
(``HostLoops.adamw`` with ``grad=(acc, g0, g1)``; 34 bytes per parameter against 12 + 30), and
against one that adds only the last micro-batch (``grad=(acc, g1)``, 32 bytes; the one before it
summed into ``acc`` earlier, 10 bytes, timed apart). Reads and writes are listed apart: the
update's rate on session 40's H100 hosts followed its reads.

    python3 bench/scripts/diag_last_pair.py [--threads 2] [--elements 33554432]

Runs on any machine (no device). Prints a markdown table, best of three passes each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from strategies.memferry import host_loops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--elements", type=int, default=1 << 25)
    args = ap.parse_args()
    loops, n = host_loops.host_loops(), args.elements
    kw = dict(grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.999, bias_correction2_sqrt=0.5, eps=1e-8,
              step_size=1e-3, threads=args.threads)
    gen = torch.Generator().manual_seed(0)
    p, m, v, acc = (torch.randn(n, generator=gen) for _ in range(4))
    v.abs_()
    w = torch.empty(n, dtype=torch.bfloat16)
    g0, g1 = (torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2))

    def separate() -> None:
        loops.accumulate_pair(acc, g0, g1, args.threads, False)
        loops.adamw(p, acc, m, v, w, **kw)

    def fused() -> None:
        loops.adamw(p, (acc, g0, g1), m, v, w, **kw)

    def one_more() -> None:
        loops.adamw(p, (acc, g1), m, v, w, **kw)

    def sum_one() -> None:
        loops.accumulate(acc, g0, args.threads)

    print(f"host: {os.cpu_count()} CPUs, {args.threads} threads, {n:,} elements; torch {torch.__version__}")
    print("| host work | read + written bytes per parameter | ns per parameter |")
    print("|---|---:|---:|")
    for name, nbytes, f in (("after the last micro-batch: sum the pair, then update", "8 + 4, 16 + 14", separate),
                            ("after the last micro-batch: update adding the pair", "20 + 14", fused),
                            ("after the last micro-batch: update adding the last one", "18 + 14", one_more),
                            ("before it: sum the one before into acc", "6 + 4", sum_one)):
        f()  # warm: pages touched, team started
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        print(f"| {name} | {nbytes} | {best / n * 1e9:.3f} |")


if __name__ == "__main__":
    main()
