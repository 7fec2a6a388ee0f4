"""Python's full garbage collections in MemFerry steps, with and without ``freeze_setup``.

Run from the repository root (cpu backend, 2 cores, torch 2.13 CPU, Python 3.11):

    OMP_NUM_THREADS=1 python bench/results/2026-12-06-cpu-session45/gc_pauses.py > bench/results/2026-12-06-cpu-session45/gc_pauses.txt

A GPT of 64 or 128 blocks (hidden 32: the objects Python tracks, not the tensors' sizes, set
what a full collection walks) under a 2 MB budget, every block homed on the host (plan auto),
15 steps; ``gc.callbacks`` time every collection by generation and the step it fell in. torch
and transformers are imported first, as the benchmark's worker has them.
"""
import gc
import os
import sys
import time

os.environ["XPU_BACKEND"] = "cpu"
sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import transformers  # noqa: E402,F401

import xpu  # noqa: E402
from strategies.memferry import AdamW, MemFerry  # noqa: E402
from strategies.models import build_model  # noqa: E402

STEPS = 15


def run(layers: int, freeze: bool) -> str:
    torch.manual_seed(0)
    model = build_model("gpt", layers=layers, hidden=32, heads=2, vocab=64, seq=16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    engine = MemFerry(model, optim=AdamW(lr=1e-3, weight_decay=0.0), plan="auto", sample=(x, y),
                      device_budget="2MB", backend=xpu.get_backend(), freeze_setup=freeze)
    walked = len(gc.get_objects())  # what a full collection walks (frozen objects are not listed)
    frozen = gc.get_freeze_count()
    events, state = [], {"step": -1, "t": 0.0}

    def observe(phase, info):
        if phase == "start":
            state["t"] = time.perf_counter()
        else:
            events.append((state["step"], info["generation"], time.perf_counter() - state["t"]))

    gc.callbacks.append(observe)
    times = []
    for step in range(STEPS):
        state["step"] = step
        t = time.perf_counter()
        engine.train_step(x, y)
        engine.synchronize()
        times.append(time.perf_counter() - t)
    gc.callbacks.remove(observe)
    engine.close()
    full = [(s, round(d * 1e3, 1)) for s, gen, d in events if gen == 2]
    young = sum(d for _, gen, d in events if gen < 2) * 1e3
    return (f"{layers:4d} blocks, freeze_setup={freeze!s:5s}: walked {walked:7d}, frozen {frozen:7d}; "
            f"full collections (step, ms) {full}; younger ones {sum(1 for e in events if e[1] < 2)} "
            f"taking {young:.1f} ms in all; steps ms {[round(t * 1e3) for t in times]}")


if __name__ == "__main__":
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, gc thresholds {gc.get_threshold()}")
    for layers in (64, 128):
        for freeze in (False, True):
            print(run(layers, freeze), flush=True)
