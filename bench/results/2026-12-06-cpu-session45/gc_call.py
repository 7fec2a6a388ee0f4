"""What a full garbage collection does to the host optimizer's loop calls (its ``call`` phase:
a call's Python side and taking the GIL back after the loop), with and without ``freeze_setup``.

Run from the repository root (cpu backend, 2 cores, torch 2.13 CPU, Python 3.11):

    OMP_NUM_THREADS=1 python bench/results/2026-12-06-cpu-session45/gc_call.py > bench/results/2026-12-06-cpu-session45/gc_call.txt

The 128-block GPT of ``gc_pauses.py`` (hidden 32, every block homed on the host), 20 steps;
per step the full collections' ms and the ``call`` phase's ms. A collection holds the GIL, so
a loop that ends during one returns only after it.
"""
import os
import statistics
import sys
import time

os.environ["XPU_BACKEND"] = "cpu"
sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import transformers  # noqa: E402,F401

import xpu  # noqa: E402
from strategies.memferry import AdamW, MemFerry  # noqa: E402
from strategies.models import build_model  # noqa: E402
from xpu.gc_clock import FullCollections  # noqa: E402

STEPS = 20


def run(freeze: bool) -> str:
    torch.manual_seed(0)
    model = build_model("gpt", layers=128, hidden=32, heads=2, vocab=64, seq=16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    engine = MemFerry(model, optim=AdamW(lr=1e-3, weight_decay=0.0), plan="auto", sample=(x, y),
                      device_budget="2MB", backend=xpu.get_backend(), freeze_setup=freeze)
    calls, steps = [], []
    with FullCollections() as collections:
        for _ in range(STEPS):
            before = engine.optimizer.time_s["call"]
            t = time.perf_counter()
            engine.train_step(x, y)
            engine.synchronize()
            steps.append(time.perf_counter() - t)
            calls.append(engine.optimizer.time_s["call"] - before)
            collections.step_done()
    engine.close()
    paused = [i for i, s in enumerate(collections.steps) if s >= 0.010]
    quiet = [c for i, c in enumerate(calls) if i not in paused and i > 0]
    hit = [calls[i] for i in paused]
    return (f"freeze_setup={freeze!s:5s}: full GC ms per step {[round(s * 1e3) for s in collections.steps]}\n"
            f"  call ms per step {[round(c * 1e3, 1) for c in calls]}\n"
            f"  step ms {[round(s * 1e3) for s in steps]}\n"
            f"  call in steps with a full GC of 10 ms or more: {[round(c * 1e3, 1) for c in hit]}; "
            f"median in the others (step 1 left out) {statistics.median(quiet) * 1e3:.1f} ms")


if __name__ == "__main__":
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    for freeze in (False, True):
        print(run(freeze), flush=True)
