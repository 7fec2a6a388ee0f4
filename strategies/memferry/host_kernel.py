"""The host AdamW update of one unit: two interchangeable kernels.

``torch``: three passes over host memory, all torch ops: upcast the landed compute-dtype
gradient into an fp32 buffer, torch's fused AdamW over the fp32 master, write the master
back into the compute-dtype working copy. 40 bytes of memory traffic per parameter (bf16).

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

from .adamw import flat_adamw
from .config import AdamW
from .shadow import UnitShadow

__all__ = ["HostKernel", "TorchKernel", "SinglePassKernel", "make_host_kernel", "KERNELS"]

_log = logging.getLogger("xpu.memferry")

KERNELS = ("auto", "torch", "single-pass")


class HostKernel:
    """Applies one AdamW step to a host-homed unit (gradient already landed in ``grad_stage``).

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


class TorchKernel(HostKernel):
    """Upcast, torch's fused AdamW, write back: three passes (see the module docstring)."""

    name = "torch"

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow]) -> None:
        self._optims = {id(s): flat_adamw(s.master, s.exp_avg, s.exp_avg_sq, s.step, cfg) for s in shadows}

    def apply(self, s: UnitShadow, coef: float) -> dict[str, float]:
        t0 = time.perf_counter()
        if s.grad is not s.grad_stage:
            s.grad.copy_(s.grad_stage)
        if coef != 1.0:
            s.grad.mul_(coef)
        t1 = time.perf_counter()
        opt = self._optims[id(s)]
        s.master.grad = s.grad
        opt.step()
        s.master.grad = None
        s.step = int(opt.state[s.master]["step"].item())
        t2 = time.perf_counter()
        s.write_back()
        return {"upcast": t1 - t0, "adamw": t2 - t1, "writeback": time.perf_counter() - t2}

    def set_lr(self, lr: float) -> None:
        for opt in self._optims.values():
            opt.param_groups[0]["lr"] = lr

    def sync_step(self, s: UnitShadow) -> None:
        self._optims[id(s)].state[s.master]["step"] = torch.tensor(float(s.step))


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
        scalars = torch.tensor([coef, 1.0 - self.lr * self.cfg.weight_decay, self.lr / bc1, math.sqrt(bc2)],
                               dtype=torch.float32)
        work = s.work if s.shard is None else s.work[s.shard]
        # Host buffers only: outside any dispatch mode (the cpu backend's device-memory tracker
        # is one), which torch.compile would refuse to run under.
        with _disable_current_modes():
            self._fn(s.master, s.grad_stage, s.exp_avg, s.exp_avg_sq, work, scalars, b1, b2, eps)
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
