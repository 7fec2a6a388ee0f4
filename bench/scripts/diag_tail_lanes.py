"""Diagnostic: could the device share the host's AdamW after a step's last micro-batch?

    python3 bench/scripts/diag_tail_lanes.py [--elements 268435456] [--chunk 8388608] [--threads N]

Under accumulation 8 the DESIGN §3 step waits about 200 ms after its last micro-batch for the
host's updates (bench/results/2026-12-05-h200-session30/call1/): one pass over 1.1 G
host-updated parameters that reads the fp32 sum of the earlier micro-batches and the last pair,
and reads and writes master and moments (34 bytes per parameter). A second lane could take part
of it: copy each chunk's sum, last pair, master and moments to the device (20 bytes), update
there, and copy master, moments and the compute-dtype copy home (14 bytes). Its bytes cross the
host's memory as DMA, which costs the host less than its own loops' (the probe's weights).

Measures, on flat pinned buffers (``--elements`` parameters, bf16 gradients):
1. the host lane alone: ``HostLoops.adamw`` with ``grad=(acc, g0, g1)``, as the host optimizer
   runs a step's last update;
2. the device lane alone: chunks copied in on one stream, updated (the host loop's order of
   operations in torch ops) on another, copied home on a third, two chunks in flight;
3. both at once, the device lane taking a share ``f`` of the parameters: the wall time of the
   slower lane, for several ``f``.
Then how many of a device lane's updated elements differ from the host lane's (same inputs).
Prints a markdown table: ns per parameter, and what the tail of 1.12 G parameters would take.
Without CUDA the device lane runs on the CPU (a smoke test of the script, no rates).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from strategies.memferry.host_loops import host_loops  # noqa: E402

HP = dict(lr=1e-4, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3)
TAIL_PARAMS = 1.12e9  # host-updated parameters of the DESIGN §3 plan under 17.7 GB


class Problem:
    """Pinned host buffers of one flat update: fp32 sum and moments, master, two bf16 gradients."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.acc = torch.randn(n, generator=g)
        self.g0 = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
        self.g1 = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
        self.master = torch.randn(n, generator=g)
        self.m = torch.randn(n, generator=g) * 0.01
        self.v = torch.rand(n, generator=g) * 1e-4
        self.work = torch.empty(n, dtype=torch.bfloat16)
        if torch.cuda.is_available():  # pinned, as the shadow model's buffers
            for name in ("acc", "g0", "g1", "master", "m", "v", "work"):
                setattr(self, name, getattr(self, name).pin_memory())

    def part(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k)[lo:hi] for k in ("acc", "g0", "g1", "master", "m", "v", "work")}


def scalars() -> dict[str, float]:
    """AdamW's per-step scalars, as the host optimizer derives them."""
    bc1 = 1 - HP["beta1"] ** HP["step"]
    bc2 = 1 - HP["beta2"] ** HP["step"]
    return dict(grad_scale=1.0, decay=1 - HP["lr"] * HP["weight_decay"], beta1=HP["beta1"], beta2=HP["beta2"],
                bias_correction2_sqrt=bc2 ** 0.5, eps=HP["eps"], step_size=HP["lr"] / bc1)


def host_lane(p: dict[str, torch.Tensor], threads: int) -> None:
    host_loops().adamw(p["master"], (p["acc"], p["g0"], p["g1"]), p["m"], p["v"], p["work"], threads=threads,
                       **scalars())


def _update(acc, g0, g1, master, m, v, work) -> None:
    """The host loop's operations in torch ops: ``(acc + g0) + g1``, then AdamW as torch's
    single-tensor AdamW orders it."""
    s = scalars()
    g = acc.add(g0.float()).add_(g1.float())
    master.mul_(s["decay"])
    m.lerp_(g, 1 - s["beta1"])
    v.mul_(s["beta2"]).addcmul_(g, g, value=1 - s["beta2"])
    denom = v.sqrt().div_(s["bias_correction2_sqrt"]).add_(s["eps"])
    master.addcdiv_(m, denom, value=-s["step_size"])
    work.copy_(master)


def device_lane(p: dict[str, torch.Tensor], chunk: int) -> None:
    """Chunks in on one stream, updated on another, home on a third; two chunks in flight."""
    n = p["master"].numel()
    if not torch.cuda.is_available():  # smoke test: the same operations on the CPU
        for lo in range(0, n, chunk):
            _update(*(p[k][lo:lo + chunk] for k in ("acc", "g0", "g1", "master", "m", "v", "work")))
        return
    dev = torch.device("cuda")
    h2d, comp, d2h = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    slots = [{k: torch.empty(chunk, dtype=p[k].dtype, device=dev) for k in p} for _ in range(2)]
    free = [None, None]
    for i, lo in enumerate(range(0, n, chunk)):
        hi, s = min(n, lo + chunk), slots[i % 2]
        w = hi - lo
        with torch.cuda.stream(h2d):
            if free[i % 2] is not None:
                h2d.wait_event(free[i % 2])
            for k in ("acc", "g0", "g1", "master", "m", "v"):
                s[k][:w].copy_(p[k][lo:hi], non_blocking=True)
            loaded = h2d.record_event()
        with torch.cuda.stream(comp):
            comp.wait_event(loaded)
            _update(*(s[k][:w] for k in ("acc", "g0", "g1", "master", "m", "v", "work")))
            done = comp.record_event()
        with torch.cuda.stream(d2h):
            d2h.wait_event(done)
            for k in ("master", "m", "v", "work"):
                p[k][lo:hi].copy_(s[k][:w], non_blocking=True)
            free[i % 2] = d2h.record_event()
    torch.cuda.synchronize()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def both(prob: Problem, n: int, f: float, threads: int, chunk: int) -> tuple[float, float, float]:
    """Wall time with the device lane on the first ``f`` of the parameters, the host on the rest;
    and each lane's own time."""
    cut = int(n * f) // 64 * 64
    times = {}

    def run_host() -> None:
        times["host"] = timed(lambda: host_lane(prob.part(cut, n), threads))

    t0 = time.perf_counter()
    th = threading.Thread(target=run_host)
    th.start()
    times["device"] = timed(lambda: device_lane(prob.part(0, cut), chunk)) if cut else 0.0
    th.join()
    return time.perf_counter() - t0, times["host"], times["device"]


def differing(chunk: int, threads: int, n: int = 1 << 20) -> int:
    """Elements of master whose device-lane update differs from the host lane's, same inputs."""
    a, b = Problem(n, seed=1), Problem(n, seed=1)
    host_lane(a.part(0, n), threads)
    device_lane(b.part(0, n), chunk)
    return int((a.master != b.master).sum() + (a.m != b.m).sum() + (a.v != b.v).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--chunk", type=int, default=1 << 23)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shares", default="0.3,0.4,0.5,0.6")
    args = ap.parse_args()
    n = args.elements
    prob = Problem(n)
    host_lane(prob.part(0, 1 << 20), args.threads)  # build and warm the loops
    device_lane(prob.part(0, min(n, 2 * args.chunk)), args.chunk)
    rows = [("host lane alone", min(timed(lambda: host_lane(prob.part(0, n), args.threads)) for _ in range(3)), None, None),
            ("device lane alone", min(timed(lambda: device_lane(prob.part(0, n), args.chunk)) for _ in range(3)), None,
             None)]
    for f in (float(x) for x in args.shares.split(",")):
        rows.append((f"both, device share {f:.2f}", *min((both(prob, n, f, args.threads, args.chunk) for _ in range(3)),
                                                          key=lambda t: t[0])))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA: device lane on the CPU"
    print(f"{n} parameters, chunks of {args.chunk}, {args.threads} host threads; {where}\n")
    print("| lanes | wall ms | ns/param | host lane ms | device lane ms | 1.12 G params (ms) |\n|---|---:|---:|---:|---:|---:|")
    for name, wall, h, d in rows:
        ns = wall / n * 1e9
        print(f"| {name} | {wall * 1e3:.1f} | {ns:.3f} | {'' if h is None else f'{h * 1e3:.1f}'} | "
              f"{'' if d is None else f'{d * 1e3:.1f}'} | {ns * TAIL_PARAMS / 1e6:.0f} |")
    print(f"\nmaster/moment elements where the device lane's update differs from the host's (1 M each): "
          f"{differing(args.chunk, args.threads)}")


if __name__ == "__main__":
    main()
