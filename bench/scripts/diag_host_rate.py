"""Diagnostic: the host AdamW rate MemFerry's scheduler plans with, measured three ways.

    python3 bench/scripts/diag_host_rate.py [--what profiler,buffers,hugepages] [--numel 50331648] [--kernel torch]

``profiler``   the profiler's own figure (``strategies.memferry.profiler.host_adamw_rate``) on
               one block-sized buffer, alone and beside 35 % host<->device copy duty;
``buffers``    the host kernel ``--kernel`` (torch, single-pass) over 1, 4 and 12 *distinct*
               block-sized units in turn, at the default thread count and at 8: does the rate
               per parameter fall as the units grow (TLB reach, NUMA placement)? Run it with
               ``XPU_HOST_HUGEPAGES=0`` and ``=1`` to compare 4 KiB and 2 MiB pages.
``hugepages``  whether ``XPU_HOST_HUGEPAGES=1`` gives a 1 GiB pinned buffer transparent huge
               pages (AnonHugePages before and after).

Session 5 (bench/results/2026-12-01-h200-session5/host-rate/, sections 1 and 4) ran these as
``profiler-rate.txt``, ``buffers-rate.txt`` and ``hugepages.txt``. Needs a backend with pinned
host memory; on the cpu backend it runs too (small ``--numel``), for a rehearsal.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import xpu

BLOCK = 50_331_648  # parameters of one docs/design.md §3 GPT block (hidden 2048)


def profiler_rate(backend: xpu.Backend, numel: int) -> None:
    """The profiler's host AdamW rate on one buffer, alone and under copy load."""
    from strategies.memferry.profiler import host_adamw_rate

    for duty in (0.0, 0.35):
        rate = host_adamw_rate(numel, torch.bfloat16, 3, backend, "torch", 0, duty)
        print(f"host_adamw_rate one {numel:,}-parameter buffer, dma_duty {duty}: {rate * 1e9:.3f} ns/param, "
              f"threads {torch.get_num_threads()}")


def _unit(backend: xpu.Backend, numel: int):
    """A host-homed unit's buffers, as the shadow model lays them out (bf16 gradient lands in place)."""
    from strategies.memferry.shadow import UnitShadow

    arena = backend.host_arena
    master, exp_avg, exp_avg_sq = (arena.empty(numel, torch.float32) for _ in range(3))
    work, grad = arena.empty(numel, torch.bfloat16), arena.empty(numel, torch.bfloat16)
    master.normal_()
    for t in (exp_avg, exp_avg_sq, work, grad):
        t.zero_()
    return UnitShadow(unit=None, work=work, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                      grad=grad, grad_stage=grad, device_flat=None, offsets=[])


def buffers_rate(backend: xpu.Backend, numel: int, kind: str = "torch", counts: tuple[int, ...] = (1, 4, 12)) -> None:
    """The host kernel ``kind`` over several distinct units in turn, best and median of 3."""
    from strategies.memferry.config import AdamW
    from strategies.memferry.host_kernel import make_host_kernel

    units = [_unit(backend, numel) for _ in range(max(counts))]
    kernel = make_host_kernel(kind, AdamW(lr=1e-4, weight_decay=0.0, host_kernel=kind), units)
    print(f"kernel {type(kernel).__name__}, {os.environ.get('XPU_HOST_HUGEPAGES', 'default')} XPU_HOST_HUGEPAGES")
    for threads in (torch.get_num_threads(), 8):
        torch.set_num_threads(threads)
        for count in counts:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for u in units[:count]:
                    kernel.apply(u, 1.0)
                times.append(time.perf_counter() - t0)
            per = count * numel
            print(f"threads {threads:2d} units {count:2d}: {min(times) / per * 1e9:.3f} ns/param (best of 3), "
                  f"median {statistics.median(times) / per * 1e9:.3f}")


def _anon_huge() -> str:
    with open("/proc/meminfo") as f:
        return next((line.strip() for line in f if line.startswith("AnonHugePages")), "AnonHugePages: ?")


def hugepages(nbytes: int = 1 << 30) -> None:
    """AnonHugePages around one pinned buffer allocated with huge pages asked for."""
    from xpu.hostmem import ENV

    os.environ[ENV] = "1"  # read when the buffer is mapped
    print("before:", _anon_huge())
    buf = xpu.get_backend().alloc_pinned(nbytes)
    buf.fill_(1)
    print(f"with a {nbytes >> 20} MiB pinned buffer (XPU_HOST_HUGEPAGES=1):", _anon_huge())


def main() -> None:
    """Run the measurements named by ``--what``, in that order."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="profiler,buffers,hugepages", help="comma list: profiler, buffers, hugepages")
    ap.add_argument("--numel", type=int, default=BLOCK, help="parameters per buffer (default one GPT block)")
    ap.add_argument("--kernel", default="torch", choices=("torch", "single-pass"), help="the host kernel `buffers` times")
    args = ap.parse_args()
    backend = xpu.get_backend()
    for what in [w.strip() for w in args.what.split(",") if w.strip()]:
        print(f"== {what}", flush=True)
        if what == "profiler":
            profiler_rate(backend, args.numel)
        elif what == "buffers":
            buffers_rate(backend, args.numel, args.kernel)
        elif what == "hugepages":
            hugepages()
        else:
            raise SystemExit(f"--what: unknown {what!r} (profiler, buffers, hugepages)")


if __name__ == "__main__":
    main()
