"""Diagnostic: the host AdamW rate of steps of 2 micro-batches (as the rehearsal runs) against steps
of the run's own count, on one engine, one step at a time.

    python3 bench/scripts/diag_rehearsal_rate.py [--layers 24] [--hidden 2048] [--device-blocks 16]
        [--accumulation 8] [--phases 0:2x2,2x3,8x4,2x2]

The rehearsal (``strategies/memferry/rehearsal.py``) checks the plan's host rate on two steps of
at most two micro-batches; on the docs/design.md §3 model with 8 micro-batches it measured 0.40
ns per parameter where the steps of 8 ran the update at 0.29 (H200, 2026-12-03), so the plan was
priced 1.58x too slow. Builds the model (GPT, bf16 compute, loss in 8 slices) under a given plan
(the first ``--device-blocks`` blocks resident and updated on the device, the others prefetched
and updated on the host, every block recomputed, embeddings and head updated on the host), then
runs ``--phases``: ``[lr:]NxK`` is K steps of N micro-batches (learning rate 0 where ``lr`` is 0,
as the rehearsal runs). Prints one row per step: micro-batches, wall seconds, and the host's
seconds per parameter over the updates finished between this step's ``step()`` return and the
previous one's (``HostOptimizer.s_per_param_since``), with its phases.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import xpu  # noqa: E402
from strategies.memferry import AdamW, MemFerry  # noqa: E402
from strategies.memferry.config import Plan, UnitPlan  # noqa: E402
from strategies.memferry.host_kernel import PHASES  # noqa: E402
from strategies.models.families import build_model  # noqa: E402


def _phases(text: str) -> list[tuple[float | None, int, int]]:
    out = []
    for part in text.split(","):
        lr, _, body = part.rpartition(":")
        n, k = body.split("x")
        out.append((float(lr) if lr else None, int(n), int(k)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device-blocks", type=int, default=16)
    ap.add_argument("--accumulation", type=int, default=8)
    ap.add_argument("--phases", default="0:2x2,2x3,8x4,2x2")
    args = ap.parse_args()
    backend = xpu.get_backend()
    model = build_model("gpt", dtype=torch.float32, layers=args.layers, hidden=args.hidden, heads=args.heads,
                        vocab=args.vocab, seq=args.seq)
    model.loss_chunks = 8
    dev = UnitPlan("resident", "resident", True, "device")
    host = UnitPlan("prefetch", "prefetch", True, "host")
    plan = Plan([dev] * args.device_blocks + [host] * (args.layers - args.device_blocks), 1, "host")
    engine = MemFerry(model, optim=AdamW(lr=1e-3), plan=plan, backend=backend, compute_dtype=torch.bfloat16,
                      blocks=model.blocks, accumulation_steps=args.accumulation)
    gen = torch.Generator().manual_seed(0)
    opt = engine.optimizer
    print(f"host kernel {opt.kernel.name}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print("| step | lr | micro-batches | wall s | host ns/param | " + " | ".join(f"{p} ms" for p in PHASES) + " |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(PHASES))
    last = opt.counters()
    times = dict(opt.time_s)
    k = 0
    for lr, n, count in _phases(args.phases):
        engine.set_lr(1e-3 if lr is None else lr)
        for _ in range(count):
            t0 = time.perf_counter()
            for _ in range(n):
                tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]) / n)
            engine.step()
            backend.synchronize(engine.device)
            wall = time.perf_counter() - t0
            rate = opt.s_per_param_since(last)
            last = opt.counters()
            spent = {p: (opt.time_s[p] - times.get(p, 0.0)) * 1e3 for p in PHASES}
            times = dict(opt.time_s)
            print(f"| {k} | {engine.cfg.lr if lr is None else lr:g} | {n} | {wall:.3f} | "
                  f"{rate * 1e9 if rate else float('nan'):.3f} | " + " | ".join(f"{spent[p]:.1f}" for p in PHASES)
                  + " |", flush=True)
            k += 1
    engine.close()


if __name__ == "__main__":
    main()
