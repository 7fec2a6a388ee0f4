"""A MemFerry step on the cpu backend (a TinyGPT of width D and L blocks, every block prefetched and
updated on the host by the single-pass loop, one thread each): the host optimizer's phases per
step, 'call' among them. Usage: engine_call_phase.py SWITCH_S D L"""
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
sys.path.insert(0, ROOT)
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan  # noqa: E402
from tests.test_memferry_numerics import TinyGPT, lm_loss  # noqa: E402
from xpu import get_backend  # noqa: E402

torch.set_num_threads(1)
interval, d, layers = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sys.setswitchinterval(interval)
torch.manual_seed(0)
engine = MemFerry(TinyGPT(vocab=64, d=d, layers=layers, seq=64),
                  optim=AdamW(lr=1e-3, host_kernel="single-pass", host_threads=1),
                  plan=Plan.uniform(layers, UnitPlan("prefetch", "prefetch")), backend=get_backend("cpu"), loss_fn=lm_loss)
gen = torch.Generator().manual_seed(0)
data = [(torch.randint(0, 64, (8, 64), generator=gen), torch.randint(0, 64, (8, 64), generator=gen)) for _ in range(30)]
opt, times = engine.optimizer, []
for i, (x, y) in enumerate(data):
    if i == 5:
        opt.wait_all()
        opt.reset_counters()
    t0 = time.perf_counter()
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    times.append(time.perf_counter() - t0)
opt.wait_all()
n = len(times) - 5
print(f"interval {interval * 1e3:.2f} ms: step {sum(times[5:]) / n * 1e3:.1f} ms; host ms/step "
      + ", ".join(f"{k} {v * 1e3 / n:.1f}" for k, v in opt.time_s.items() if v))
engine.close()
