"""Train the benchmark GPT with MemFerry and report step time, memory and traffic per plan.

    python examples/memferry_gpt.py --preset tiny --steps 4              # any backend, seconds
    python examples/memferry_gpt.py --preset design --plans prefetch,prefetch+recompute

Each plan runs in this process one after another on a fresh engine; the last lines are a
table. ``--plans`` items: ``prefetch``, ``prefetchN`` (depth N), ``dha``, ``residentN``
(first N blocks resident, the rest prefetched), ``deviceN`` (first N blocks and the
embeddings/head homed on the device with a device optimizer, the rest prefetched with the
host optimizer), each optionally ``+recompute``; ``plain``
is the model all on the device with torch's fused AdamW, for reference.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import xpu  # noqa: E402
from strategies.models import build_model, flops_per_token  # noqa: E402
from strategies.memferry import AdamW, MemFerry, Plan  # noqa: E402

PRESETS = {
    "tiny": dict(layers=4, hidden=128, heads=4, vocab=512, seq=64, batch=4),
    "design": dict(layers=24, hidden=2048, heads=16, vocab=32000, seq=1024, batch=8),
}


def run(plan_name: str, args: argparse.Namespace, dims: dict, batch: int, dtype: torch.dtype) -> dict:
    b = xpu.get_backend()
    torch.manual_seed(0)
    model = build_model("gpt", dtype=dtype, **dims)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, dims["vocab"], (batch, dims["seq"]), generator=g),
             torch.randint(0, dims["vocab"], (batch, dims["seq"]), generator=g)) for _ in range(4)]
    cfg = AdamW(lr=1e-4, weight_decay=0.1)
    b.reset_peak_memory(0)
    t_setup = time.perf_counter()
    if plan_name == "plain":
        with b.device_scope(0):
            model = model.to(b.device(0))
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
            data = [(b.to_device(x, 0), b.to_device(y, 0)) for x, y in data]

        def step(x, y):
            with b.device_scope(0):
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

        finish = lambda: b.synchronize(0)  # noqa: E731
        engine = None
    else:
        budget = f"{args.budget_gb}GB" if args.budget_gb else None
        engine = MemFerry(model, optim=cfg, plan=Plan.from_spec(plan_name, dims["layers"]), device_budget=budget)
        step = engine.train_step
        finish = engine.synchronize
    setup_s = time.perf_counter() - t_setup
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        loss = step(x, y)
        if args.sync_each:
            finish()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    finish()
    t_total = sum(times[args.warmup:])
    steady = t_total / args.steps
    stats = b.memory_stats(0)
    row = {
        "plan": plan_name, "step_s": round(steady, 4), "setup_s": round(setup_s, 1),
        "tflops": round(flops_per_token("gpt", **dims) * batch * dims["seq"] / steady / 1e12, 1),
        "peak_device_gb": round(stats.peak_reserved / 1e9, 2), "peak_alloc_gb": round(stats.peak_allocated / 1e9, 2),
        "losses": [round(float(l), 4) for l in losses],
    }
    if engine is not None:
        n = args.warmup + args.steps
        row.update({"h2d_gb_per_step": round(engine.executor.bytes_h2d / n / 1e9, 2),
                    "d2h_gb_per_step": round(engine.executor.bytes_d2h / n / 1e9, 2),
                    "host_optimizer_s_per_step": {k: round(v / n, 4) for k, v in engine.optimizer.time_s.items()}})
        engine.close()
    model = engine = step = data = None  # freed now (the closures above name them: rebound, not deleted)
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--plans", default="plain,prefetch,prefetch+recompute")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on an accelerator, fp32 on cpu")
    parser.add_argument("--budget-gb", type=float, default=None, help="device memory cap for MemFerry plans")
    parser.add_argument("--sync-each", action="store_true", help="wait for the optimizer after every step")
    parser.add_argument("--json", default=None, help="append rows to this JSON-lines file")
    args = parser.parse_args()
    b = xpu.get_backend()
    dims = dict(PRESETS[args.preset])
    batch = dims.pop("batch")
    dtype_name = args.dtype or ("bf16" if b.caps.async_copy else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    rows = []
    for plan_name in args.plans.split(","):
        try:
            row = run(plan_name, args, dims, batch, dtype)
        except torch.OutOfMemoryError as exc:
            row = {"plan": plan_name, "error": f"OOM: {str(exc)[:200]}"}
        row.update(preset=args.preset, dtype=dtype_name, backend=b.name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    print(f"\n{'plan':24s} {'step s':>8s} {'TFLOP/s':>8s} {'peak GB':>8s} {'opt s':>7s} {'H2D GB':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:24s} {r['error'][:60]}")
            continue
        print(f"{r['plan']:24s} {r['step_s']:8.3f} {r['tflops']:8.1f} {r['peak_device_gb']:8.2f} "
              f"{sum(r.get('host_optimizer_s_per_step', {}).values()) - r.get('host_optimizer_s_per_step', {}).get('wait', 0):7.3f} "
              f"{r.get('h2d_gb_per_step', 0):7.2f}")


if __name__ == "__main__":
    main()
