"""Why is MemFerry's host AdamW slower inside a training step than alone?

    python3 bench/scripts/diag_host_adamw.py [--numel 50331648] [--full]

Measures, on one block-sized flat buffer (pinned, as the shadow model's), the host
optimizer's three phases (gradient upcast bf16->fp32, fused AdamW, fp32->bf16 write-back)
in a worker thread as HostOptimizer runs them, for several OpenMP thread counts, alone, with
a busy Python main thread (as during a step: it launches kernels), and with host<->device
DMA running. With ``--full``, also the docs/design.md §3 calibration: fused AdamW over 1.34 B
fp32 parameters with the default threads (0.30 s on the lent H200 machine on 2026-11-29),
which says whether this machine's CPU is as fast as when the anchors were measured. A
single-pass variant compiled by torch.compile (upcast + AdamW + write-back in one loop) is
timed too, if the compiler works here. Prints one JSON object per measurement, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch


def cpu_facts() -> dict:
    cores = set()
    try:
        phys = core = None
        for line in open("/proc/cpuinfo"):
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                cores.add((phys, core))
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "physical_cores": len(cores) or None,
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "parallel_info": torch.__config__.parallel_info().splitlines()[:8]}


def pinned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, pin_memory=torch.cuda.is_available())


class Phases:
    def __init__(self, n: int) -> None:
        self.master, self.grad, self.m, self.v = (pinned(n, torch.float32) for _ in range(4))
        self.master.normal_()
        self.grad.normal_()
        self.m.zero_()
        self.v.zero_()
        self.stage, self.work = pinned(n, torch.bfloat16), pinned(n, torch.bfloat16)
        self.stage.copy_(self.grad)
        self.opt = torch.optim.AdamW([self.master], lr=1e-4, fused=True)
        self.opt.state[self.master] = {"step": torch.tensor(0.0), "exp_avg": self.m, "exp_avg_sq": self.v}

    def once(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        self.grad.copy_(self.stage)
        t1 = time.perf_counter()
        self.master.grad = self.grad
        self.opt.step()
        self.master.grad = None
        t2 = time.perf_counter()
        self.work.copy_(self.master)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2


def in_thread(fn, threads: int | None):
    out = {}

    def run():
        if threads:
            torch.set_num_threads(threads)
        out["r"] = fn()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["r"]


def measure(ph: Phases, threads: int | None, repeats: int = 5) -> dict:
    def fn():
        ph.once()
        return [ph.once() for _ in range(repeats)]
    rows = in_thread(fn, threads)
    med = [statistics.median(col) * 1e3 for col in zip(*rows)]
    return {"upcast_ms": round(med[0], 2), "adamw_ms": round(med[1], 2), "writeback_ms": round(med[2], 2),
            "total_ms": round(sum(med), 2)}


class Busy:
    """Background load: a Python thread launching small device kernels (like a training step's
    main thread), and/or host<->device DMA in both directions."""

    def __init__(self, python: bool = False, dma: bool = False) -> None:
        self.stop = threading.Event()
        self.threads = []
        if python:
            self.threads.append(threading.Thread(target=self._python, daemon=True))
        if dma and torch.cuda.is_available():
            self.threads.append(threading.Thread(target=self._dma, daemon=True))

    def _python(self) -> None:
        x = torch.ones(1024, device="cuda") if torch.cuda.is_available() else torch.ones(16)
        while not self.stop.is_set():
            for _ in range(200):
                x.add_(1)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def _dma(self) -> None:
        n = 256 << 20
        h1, h2 = pinned(n // 2, torch.bfloat16), pinned(n // 2, torch.bfloat16)
        d1, d2 = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda"), torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        while not self.stop.is_set():
            with torch.cuda.stream(s1):
                d1.copy_(h1, non_blocking=True)
            with torch.cuda.stream(s2):
                h2.copy_(d2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def fused_single_pass(ph: Phases, threads: int | None) -> dict:
    """upcast + AdamW + write-back as one compiled loop (what a custom CPU kernel would do)."""
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.0

    def step(p, g16, m, v, w16, lr, bc1, bc2):
        g = g16.float()
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - lr * wd)
        p.sub_(lr * (m / bc1) / ((v / bc2).sqrt() + eps))
        w16.copy_(p)

    try:
        compiled = torch.compile(step, dynamic=False)
        lr, bc1, bc2 = torch.tensor(1e-4), torch.tensor(0.1), torch.tensor(0.001)
        t0 = time.perf_counter()
        in_thread(lambda: compiled(ph.master, ph.stage, ph.m, ph.v, ph.work, lr, bc1, bc2), threads)
        compile_s = time.perf_counter() - t0

        def fn():
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                compiled(ph.master, ph.stage, ph.m, ph.v, ph.work, lr, bc1, bc2)
                ts.append(time.perf_counter() - t)
            return ts
        ts = in_thread(fn, threads)
        return {"single_pass_ms": round(statistics.median(ts) * 1e3, 2), "compile_s": round(compile_s, 1)}
    except Exception as exc:  # report, do not fail the diagnosis
        return {"single_pass_error": f"{type(exc).__name__}: {exc}"[:300]}


def chunked_kernel(ph: Phases, threads: int | None, load: str) -> dict:
    """MemFerry's TorchKernel: the same three passes in cache-sized chunks (host_kernel.py)."""
    from strategies.memferry.config import AdamW
    from strategies.memferry.host_kernel import TorchKernel
    from strategies.memferry.shadow import UnitShadow

    s = UnitShadow(None, ph.work, ph.master, ph.m, ph.v, ph.stage, ph.stage, None, [])
    k = TorchKernel(AdamW(lr=1e-4, weight_decay=0.0), [s])

    def fn():
        k.apply(s, 1.0)
        return [k.apply(s, 1.0) for _ in range(5)]
    with Busy(python="python" in load, dma="dma" in load):
        rows = in_thread(fn, threads)
    med = {key: statistics.median(r[key] for r in rows) * 1e3 for key in rows[0]}
    return {"upcast_ms": round(med["upcast"], 2), "adamw_ms": round(med["adamw"], 2),
            "writeback_ms": round(med["writeback"], 2), "total_ms": round(sum(med.values()), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_331_648)  # one docs/design.md §3 GPT block (hidden 2048)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--threads", default="")
    args = ap.parse_args()
    facts = cpu_facts()
    print(json.dumps({"facts": facts}), flush=True)
    results = []
    if args.full:
        n = 1_339_674_624
        p, g, m, v = (torch.empty(n) for _ in range(4))
        p.normal_(), g.normal_(), m.zero_(), v.zero_()
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
        p.grad = g
        ts = []
        for _ in range(4):
            t = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t)
        res = {"case": "calibration: fused AdamW 1.34B fp32, default threads (docs/design.md §3: 0.30 s)",
               "s": round(statistics.median(ts[1:]), 3)}
        print(json.dumps(res), flush=True)
        results.append(res)
        del p, g, m, v, opt
    ph = Phases(args.numel)
    nthreads = [int(x) for x in args.threads.split(",") if x] or sorted({facts["torch_threads"], facts["torch_threads"] - 1,
                                                                      facts["torch_threads"] - 2, max(1, facts["torch_threads"] // 2)}, reverse=True)
    for load in ("alone", "busy-python", "dma", "busy-python+dma"):
        for t in nthreads:
            with Busy(python="python" in load, dma="dma" in load):
                res = {"case": load, "threads": t, **measure(ph, t)}
            print(json.dumps(res), flush=True)
            results.append(res)
    for load in ("alone", "dma"):
        res = {"case": f"chunked TorchKernel, {load}", "threads": nthreads[0], **chunked_kernel(ph, nthreads[0], load)}
        print(json.dumps(res), flush=True)
        results.append(res)
    for t in nthreads[:2]:
        res = {"case": "single-pass compiled, alone", "threads": t, **fused_single_pass(ph, t)}
        print(json.dumps(res), flush=True)
        results.append(res)
    print(f"\nper block of {args.numel / 1e6:.1f} M params (ms)")
    print(f"{'case':<34}{'thr':>4}{'upcast':>9}{'adamw':>9}{'wback':>9}{'total':>9}")
    for r in results:
        if "threads" in r and "total_ms" in r:
            print(f"{r['case']:<34}{r['threads']:>4}{r['upcast_ms']:>9}{r['adamw_ms']:>9}{r['writeback_ms']:>9}{r['total_ms']:>9}")
        else:
            print(r)


if __name__ == "__main__":
    main()
