"""The AdamW rates MemFerry's profiler measures: the host optimizer's update of one unit (alone,
and beside host<->device copies that share host memory with it) and the device optimizer's.
Seconds per parameter, for the cost model (``profiler.profile_step`` records them)."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from xpu import Backend
from xpu.host_bandwidth import CopyLoad
from xpu.timing import event_seconds

__all__ = ["host_adamw_rate", "host_adamw_rates", "device_adamw_rate"]


def host_adamw_rate(numel: int = 4_000_000, dtype: torch.dtype = torch.bfloat16, repeats: int = 3,
                    backend: Backend | None = None, kernel: str = "auto", device: int | None = None,
                    dma_duty: float = 0.0) -> float:
    """Seconds per parameter of the host optimizer's update of one unit, with the kernel
    ``HostOptimizer`` would use (``kernel``, see ``host_kernel.py``; conversions included).

    Buffers come from the backend's pinned arena when ``backend`` is given (as in training).
    With ``dma_duty`` > 0 (and a backend with asynchronous copies), host<->device copies in
    both directions run that fraction of the time meanwhile, as a step's prefetches and
    gradient copies do: they share host memory bandwidth with the update (on the H200
    machine, full-duplex copies made the update 1.9x slower).
    """
    return host_adamw_rates(numel, dtype, repeats, backend, kernel, device, (dma_duty,))[0][0]


def host_adamw_rates(numel: int, dtype: torch.dtype, repeats: int, backend: Backend | None, kernel: str,
                     device: int | None, duties: tuple[float, ...]) -> list[tuple[float, float]]:
    """``(seconds per parameter, GB/s the copies moved meanwhile)`` of the host update (see
    :func:`host_adamw_rate`) at each copy duty of ``duties``, on one set of buffers. A duty of 0,
    or a backend whose copies are no link traffic (virtual devices are host memory; no
    asynchronous copies), runs no copies and reports 0 GB/s."""
    from .config import AdamW
    from .host_kernel import make_host_kernel
    from .shadow import UnitShadow

    def buf(dt: torch.dtype) -> torch.Tensor:
        return backend.host_arena.empty(numel, dt) if backend is not None else torch.empty(numel, dtype=dt)

    master, m, v = (buf(torch.float32) for _ in range(3))
    master.normal_()
    m.zero_()
    v.zero_()
    low = dtype != torch.float32
    work, stage = (buf(dtype), buf(dtype)) if low else (master, buf(torch.float32))
    stage.normal_()
    shadow = UnitShadow(None, work, master, m, v, stage, stage, None, [])
    k = make_host_kernel(kernel, AdamW(lr=1e-4, weight_decay=0.0, host_kernel=kernel), [shadow])
    copies_ok = backend is not None and backend.caps.async_copy and not backend.caps.virtual_devices
    out = []
    try:
        for duty in duties:
            load: Any = contextlib.nullcontext()
            if duty > 0 and copies_ok:
                load = CopyLoad(backend, backend.index_of(device), min(1.0, duty))
            times = []
            with load:
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    k.apply(shadow, 1.0)
                    if i:
                        times.append(time.perf_counter() - t0)
            out.append((statistics.median(times) / numel, load.rate_GBps if isinstance(load, CopyLoad) else 0.0))
    finally:
        if backend is not None:
            for t in {id(t): t for t in (master, m, v, work, stage)}.values():
                backend.host_arena.release(t)
    return out


def device_adamw_rate(backend: Backend, device: int, numel: int = 4_000_000, dtype: torch.dtype = torch.bfloat16,
                      repeats: int = 3) -> float:
    """Seconds per parameter of ``DeviceOptimizer``'s work on the device: gather the
    compute-dtype gradient into fp32, fused AdamW, write the compute-dtype weights."""
    with backend.device_scope(device):
        master, grad, m, v = (backend.empty(numel, torch.float32, device) for _ in range(4))
        master.normal_()
        m.zero_()
        v.zero_()
        pgrad = backend.empty(numel, dtype, device)
        pgrad.normal_()
        work = backend.empty(numel, dtype, device) if dtype != torch.float32 else master
        opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
        opt.state[master] = {"step": torch.tensor(0.0, device=master.device), "exp_avg": m, "exp_avg_sq": v}

        def step() -> None:
            grad.copy_(pgrad)
            master.grad = grad
            opt.step()
            master.grad = None
            if work is not master:
                work.copy_(master)

        stream = backend.current_stream(device)
        times = [event_seconds(backend, stream, step) for _ in range(repeats + 1)][1:]
    return statistics.median(times) / numel
