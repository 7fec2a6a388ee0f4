"""The single-pass host AdamW's three forms, timed alone: in place, saving the old state to a
backup, and from a backup into another buffer (speculative clipping's update into a spare).

Usage: python3 bench/scripts/diag_host_forms.py [--numel N] [--threads T] [--repeats R]
Prints one line per form: median ns per parameter over R calls (after one untimed call), on
N-element fp32 master and moments with a bf16 gradient and working copy, T threads (default:
torch's intra-op count).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from strategies.memferry.host_loops import host_loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n, loops = args.numel, host_loops()
    state = [torch.randn(n), torch.randn(n), torch.rand(n)]
    other = [t.clone() for t in state]
    grad, work = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    kw = dict(grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.999, bias_correction2_sqrt=1.0, eps=1e-8,
              step_size=1e-6, threads=args.threads)
    forms = {"in place": lambda: loops.adamw(state[0], grad, state[1], state[2], work, **kw),
             "save": lambda: loops.adamw(state[0], grad, state[1], state[2], work, save=tuple(other), **kw),
             "from (into a spare)": lambda: loops.adamw(other[0], grad, other[1], other[2], work, source=tuple(state),
                                                        **kw)}
    print(f"numel {n}, threads {args.threads}")
    for name, fn in forms.items():
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:<22} {statistics.median(times) / n * 1e9:.3f} ns/param")


if __name__ == "__main__":
    main()
