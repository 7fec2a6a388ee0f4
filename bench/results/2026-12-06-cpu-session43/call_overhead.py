"""The Python side of one single-pass AdamW loop call (``HostLoops.adamw``): 1024-parameter calls
on one thread, so the loop itself is a few µs, which the call clocks inside and this subtracts.
Run from the repository root with OMP_NUM_THREADS=1; prints µs per call over five rounds of 2000."""
import time

import torch

from strategies.memferry.host_loops import host_loops

loops = host_loops()
n = 1024
master, exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n)
grad, work = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)


def once() -> float:
    return loops.adamw(master, grad, exp_avg, exp_avg_sq, work, grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.999,
                       bias_correction2_sqrt=1.0, eps=1e-8, step_size=1e-3, threads=1)


for _ in range(200):
    once()
rounds = []
for _ in range(5):
    t0, loop = time.perf_counter(), 0.0
    for _ in range(2000):
        loop += once()
    rounds.append((time.perf_counter() - t0 - loop) / 2000 * 1e6)
print("python side of one adamw call, us:", [round(x, 1) for x in rounds])
