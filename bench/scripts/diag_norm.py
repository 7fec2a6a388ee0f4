"""Diagnostic: what summing a step's squared gradient entries costs on the device, by method.

    python3 bench/scripts/diag_norm.py [--params 0.99e9] [--repeats 5]

Clipping's norm (``strategies/memferry/clip_norms.py``) sums the squares of every gradient of a
step in fp64 on the compute stream (``adamw.squared_norm``). This times, on bf16 gradients shaped
like GPT blocks (hidden 2048: weights 2048x6144, 2048x2048, 2048x8192, 8192x2048), the step's
whole sum by each way of computing it, with the GPU's own events (device time) and the host's
clock (what the training thread spends issuing it). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from strategies.memferry.adamw import squared_norm  # noqa: E402

SHAPES = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]


def grads(total: float, device: str) -> list[torch.Tensor]:
    """bf16 tensors of the block shapes, about ``total`` elements in all."""
    out, n = [], 0
    while n < total:
        for shape in SHAPES:
            out.append(torch.randn(shape, device=device, dtype=torch.bfloat16) * 1e-3)
            n += out[-1].numel()
    return out


def methods() -> dict[str, callable]:
    """name -> fn(list of tensors) returning a 0-dim sum of squares."""
    def current(gs):
        return torch.stack([squared_norm(g) for g in gs]).sum()

    def whole_chunk(gs):  # one fp64 cast per tensor (memory: 8 B per element of the largest)
        return torch.stack([g.double().square().sum() for g in gs]).sum()

    def fp32_sq_fp64_sum(gs):
        return torch.stack([g.float().square_().sum(dtype=torch.float64) for g in gs]).sum()

    def vecnorm_fp32(gs):  # not exact: timing only
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in gs]).double().square().sum()

    def foreach_norm(gs):  # not exact: timing only
        return torch.stack(torch._foreach_norm(gs)).double().square().sum()

    def dot_fp32(gs):  # not exact: timing only
        return torch.stack([torch.dot(g.reshape(-1).float(), g.reshape(-1).float()) for g in gs]).double().sum()

    return {"current squared_norm (4M chunks)": current, "whole tensor .double()": whole_chunk,
            "fp32 square, fp64 sum": fp32_sq_fp64_sum, "vector_norm fp32 (inexact)": vecnorm_fp32,
            "_foreach_norm (inexact)": foreach_norm, "dot fp32 (inexact)": dot_fp32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=0.99e9)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = "cuda"
    gs = grads(args.params, dev)
    n = sum(g.numel() for g in gs)
    ref = methods()["current squared_norm (4M chunks)"](gs).item()
    print(f"{len(gs)} tensors, {n / 1e6:.0f} M elements, sum of squares {ref:.6e}\n")
    print("| method | device ms | host issue ms | relative difference to current |")
    print("|---|---:|---:|---:|")
    for name, fn in methods().items():
        fn(gs)
        torch.cuda.synchronize()
        dev_ms, host_ms = [], []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            out = fn(gs)
            b.record()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            dev_ms.append(a.elapsed_time(b))
        diff = abs(out.item() - ref) / ref
        print(f"| {name} | {sorted(dev_ms)[len(dev_ms) // 2]:.2f} | {sorted(host_ms)[len(host_ms) // 2]:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
