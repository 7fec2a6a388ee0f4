"""The host AdamW update of one unit: two interchangeable kernels.

``torch``: three passes, all torch ops: upcast the landed compute-dtype gradient into fp32,
torch's fused AdamW over the fp32 master, write the master back into the compute-dtype
working copy; done in cache-sized chunks so the intermediate passes mostly hit the CPU cache
(40 bytes of traffic per bf16 parameter when done whole, closer to 28 in chunks).

``single-pass`` (experimental, opt-in): the same arithmetic as one loop compiled by
``torch.compile`` (Inductor's C++/OpenMP code on the host): it reads the bf16 gradient,
updates master and moments and writes the bf16 working copy in one sweep, 28 bytes per
parameter. Compiled for one fixed size it ran a 50 M-parameter block in 13.2 ms against
20.8 ms for ``torch`` (H200 machine, 2026-11-29, bench/results/2026-11-29-h200-session2/diag/);
but this dynamic-size build ran 3-4x *slower* than ``torch`` inside real training steps on the
same machine (capped run, same folder), for a reason not yet found. Hence:

``auto`` is ``torch`` for now. Both give AdamW as ``torch.optim.AdamW`` defines it
(decoupled weight decay, bias-corrected moments); ``single-pass`` needs a C++ compiler.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .adamw import decay_ranges, flat_adamw
from .config import AdamW
from .shadow import UnitShadow

__all__ = ["HostKernel", "TorchKernel", "SinglePassKernel", "make_host_kernel", "default_chunk", "KERNELS"]

_log = logging.getLogger("xpu.memferry")

KERNELS = ("auto", "torch", "single-pass")


class HostKernel:
    """Applies one AdamW step to a host-homed unit (gradient already in ``grad_source``: the
    landed ``grad_stage``, or the fp32 sum of a step's micro-batches).

    ``apply`` returns the seconds spent per phase (``upcast``, ``adamw``, ``writeback``; a
    single-pass kernel reports everything as ``adamw``) and advances ``shadow.step``.
    """

    name = "?"

    def apply(self, s: UnitShadow, coef: float) -> dict[str, float]:
        """One update of ``s`` with its gradient scaled by ``coef`` (global-norm clipping)."""
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        """Learning rate of the following updates."""
        raise NotImplementedError

    def sync_step(self, s: UnitShadow) -> None:
        """Take the step count from ``s.step`` (after loading a checkpoint)."""


def _l3_bytes() -> int | None:
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units and text[:-1].isdigit() else None


def default_chunk() -> int:
    """Elements per chunk of :class:`TorchKernel`: a chunk's fp32 master, moments and gradient
    scratch plus its 16-bit gradient and weights take 20 B per element; half the L3 cache
    holds it (300 MiB on the H200 machine: 7.9 Mi elements), so the upcast's output and the
    updated master are still cached when the next pass reads them. 1 Mi at least, 4 Mi when
    the cache size is unknown."""
    l3 = _l3_bytes()
    return max(1 << 20, l3 // 40) if l3 else 4 << 20


class TorchKernel(HostKernel):
    """Upcast, torch's fused AdamW, write back, chunk by chunk (see the module docstring).

    Working in cache-sized chunks keeps the three passes' intermediate traffic in the CPU's
    cache, and needs only one chunk of fp32 gradient scratch instead of a whole fp32 gradient
    per unit (4 bytes per parameter of host memory saved).
    """

    name = "torch"

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], chunk: int | None = None) -> None:
        chunk = default_chunk() if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.chunk = chunk
        # Chunks never straddle the weight-decay boundary: each is in one group (decay or none).
        ranges = {id(s): decay_ranges(s.master.numel(), s.decay_end, chunk) for s in shadows}
        self._bounds = {key: [(a, b) for a, b, _ in r] for key, r in ranges.items()}
        self._optims = {id(s): [flat_adamw(s.master[a:b], s.exp_avg[a:b], s.exp_avg_sq[a:b], s.step, cfg,
                                           weight_decay=None if decays else 0.0)
                                for a, b, decays in ranges[id(s)]] for s in shadows}
        low = [s for s in shadows if s.grad_stage.dtype != torch.float32]
        largest = max((min(chunk, s.master.numel()) for s in low), default=0)
        # One fp32 gradient chunk, reused: the worker updates one unit at a time.
        self._scratch = torch.empty(largest, dtype=torch.float32) if largest else None

    def apply(self, s: UnitShadow, coef: float) -> dict[str, float]:
        times = {"upcast": 0.0, "adamw": 0.0, "writeback": 0.0}
        src = s.grad_source
        low = src.dtype != torch.float32
        work = None if s.master_is_work else s.train_work
        for (a, b), opt in zip(self._bounds[id(s)], self._optims[id(s)]):
            t0 = time.perf_counter()
            if low:
                g = self._scratch[: b - a]
                g.copy_(src[a:b])
            else:
                g = src[a:b]  # fp32 gradients (landed or accumulated) are used in place; consumed by this update
            if coef != 1.0:
                g.mul_(coef)
            t1 = time.perf_counter()
            p = opt.param_groups[0]["params"][0]
            p.grad = g
            opt.step()
            p.grad = None
            t2 = time.perf_counter()
            if work is not None:
                work[a:b].copy_(p)
            t3 = time.perf_counter()
            times["upcast"] += t1 - t0
            times["adamw"] += t2 - t1
            times["writeback"] += t3 - t2
        s.step += 1
        return times

    def set_lr(self, lr: float) -> None:
        for opts in self._optims.values():
            for opt in opts:
                opt.param_groups[0]["lr"] = lr

    def sync_step(self, s: UnitShadow) -> None:
        for opt in self._optims[id(s)]:
            p = opt.param_groups[0]["params"][0]
            opt.state[p]["step"] = torch.tensor(float(s.step))


def _single_pass(master: torch.Tensor, grad_low: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 work: torch.Tensor, scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    # scalars = [gradient scale, 1 - lr * weight_decay, lr / bias_correction1, sqrt(bias_correction2)]:
    # tensors, so a new step or learning rate does not recompile.
    g = grad_low.float() * scalars[0]
    master.mul_(scalars[1])
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / scalars[3] + eps
    master.sub_(exp_avg / denom * scalars[2])
    work.copy_(master)


_COMPILED: Callable | None = None


def _compiled() -> Callable:
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_single_pass, dynamic=True, fullgraph=True)
    return _COMPILED


class SinglePassKernel(HostKernel):
    """Upcast + AdamW + write-back as one compiled loop (see the module docstring).

    Raises at construction if this machine cannot compile it (the caller falls back).
    """

    name = "single-pass"

    def __init__(self, cfg: AdamW) -> None:
        self.cfg = cfg
        self.lr = cfg.lr
        self._fn = _compiled()
        self._warm_up()

    def _warm_up(self) -> None:
        # Compile now, on a small buffer, instead of inside the first training step. Sizes
        # are dynamic, so units of every size reuse this one kernel.
        n = 4099
        with _disable_current_modes():
            m32 = [torch.zeros(n) for _ in range(3)]
            g, w = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(m32[0], 0)
            self._fn(m32[0], g, m32[1], m32[2], w, torch.tensor([1.0, 1.0, 1.0, 1.0]), *self._consts())

    def _consts(self) -> tuple[float, float, float]:
        b1, b2 = self.cfg.betas
        return float(b1), float(b2), float(self.cfg.eps)

    def apply(self, s: UnitShadow, coef: float) -> dict[str, float]:
        t0 = time.perf_counter()
        step = s.step + 1
        b1, b2, eps = self._consts()
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        work, grad = s.train_work, s.grad_source
        # Host buffers only: outside any dispatch mode (the cpu backend's device-memory tracker
        # is one), which torch.compile would refuse to run under.
        with _disable_current_modes():
            for a, b, decays in decay_ranges(s.master.numel(), s.decay_end):
                wd = self.cfg.weight_decay if decays else 0.0
                scalars = torch.tensor([coef, 1.0 - self.lr * wd, self.lr / bc1, math.sqrt(bc2)], dtype=torch.float32)
                self._fn(s.master[a:b], grad[a:b], s.exp_avg[a:b], s.exp_avg_sq[a:b], work[a:b], scalars, b1, b2, eps)
        s.step = step
        return {"upcast": 0.0, "adamw": time.perf_counter() - t0, "writeback": 0.0}

    def set_lr(self, lr: float) -> None:
        self.lr = lr


def make_host_kernel(kind: str, cfg: AdamW, shadows: list[UnitShadow]) -> HostKernel:
    """The host kernel ``kind`` (one of :data:`KERNELS`) for the host-homed ``shadows``.

    Raises:
        ValueError: unknown ``kind``.
        RuntimeError: ``"single-pass"`` asked for explicitly and it cannot compile here.
    """
    if kind not in KERNELS:
        raise ValueError(f"unknown host kernel {kind!r}; valid: {', '.join(KERNELS)}")
    if kind in ("torch", "auto") or not shadows:
        return TorchKernel(cfg, shadows)
    try:
        return SinglePassKernel(cfg)
    except Exception as exc:  # no compiler, or a torch without Inductor's CPU backend
        if kind == "single-pass":
            raise RuntimeError(f"the single-pass host AdamW kernel could not be compiled here: {exc}; "
                               "use host_kernel='torch'") from exc
        _log.warning("MemFerry: single-pass host AdamW unavailable (%s: %s); using torch's fused AdamW in three passes",
                     type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return TorchKernel(cfg, shadows)
