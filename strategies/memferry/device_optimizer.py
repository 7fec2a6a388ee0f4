"""AdamW on the device for units homed there, run on the compute stream as gradients land.

A device-homed unit keeps its fp32 master and moments in device memory; its update is a few
fused kernels queued right after the unit's last gradient, so it costs microseconds of device
time instead of host memory bandwidth. Stream order makes the next forward see the update.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .adamw import decay_ranges, flat_adamw
from .clip_norms import DeviceNorms
from .config import AdamW
from .device_accumulation import add_grads
from .shadow import UnitShadow

__all__ = ["DeviceOptimizer"]


class DeviceOptimizer:
    """Updates device-homed units; with clipping, holds updates until :meth:`finish_step`.

    Args:
        cfg: optimizer settings.
        shadows: all units' buffers; only those with ``home == "device"`` are handled.
        backend: gives the fp32 gradient buffer memory only while an update needs it.
        norms: with clipping, where the held gradients' squares are summed (the engine's
            ``GlobalNormClip.norms``; None: a sum of this optimizer's own).
    """

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], backend: Any, norms: DeviceNorms | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        # Per unit, one optimizer per weight-decay group: (start, stop, optimizer) over the master.
        self._optims = {s.unit.index: [(a, b, flat_adamw(s.master[a:b], s.exp_avg[a:b], s.exp_avg_sq[a:b], s.step, cfg,
                                                         weight_decay=None if decays else 0.0))
                                       for a, b, decays in decay_ranges(s.master.numel(), s.decay_end)]
                        for s in shadows if s.home == "device" and s.master.numel()}
        self._pending: list[UnitShadow] = []
        self.norms = norms if norms is not None else DeviceNorms()
        # With clipping and one micro-batch alone: units' gradients as autograd made them (the
        # compute dtype, half the fp32 buffer's bytes in bf16), held until the coefficient is known.
        self._held: dict[int, list[torch.Tensor]] = {}
        # Units summing micro-batches' gradients in their fp32 buffer (gradient accumulation),
        # with the reduction (data parallelism) their sum will take once complete.
        self._open: dict[int, tuple[UnitShadow, Callable[[torch.Tensor], None] | None]] = {}

    def __contains__(self, shadow: UnitShadow) -> bool:
        return shadow.unit.index in self._optims

    def grads_ready(self, s: UnitShadow, reduce: Callable[[torch.Tensor], None] | None = None,
                    final: bool = True) -> None:
        """Gather the unit's gradients (upcast into its flat fp32 buffer, or added to what earlier
        micro-batches left there); when ``final`` (the step's last micro-batch), average the sum
        over ranks with ``reduce`` if given, and update the unit, or hold the update until the
        clip coefficient is known."""
        first = s.unit.index not in self._open
        if first and final and reduce is None and self.cfg.max_grad_norm is not None:
            held = [p.grad for _, p in s.unit.trainable]
            for _, p in s.unit.trainable:
                p.grad = None
            self._held[s.unit.index] = held
            self.norms.add(held)
            self._pending.append(s)
            return
        if first:
            self.backend.realloc_storage(s.grad)
        add_grads(s, s.grad, first)
        self._open[s.unit.index] = (s, reduce)
        if final:
            self._complete(s.unit.index)

    def flush(self) -> None:
        """The step ends before its last micro-batch: complete every accumulated gradient."""
        for index in list(self._open):
            self._complete(index)

    def _complete(self, index: int) -> None:
        s, reduce = self._open.pop(index)
        if reduce is not None:
            reduce(s.grad)  # once per step, on the sum: averaging is linear
        if self.cfg.max_grad_norm is None:
            self._update(s, 1.0)
        else:
            self.norms.add([s.grad])
            self._pending.append(s)

    def finish_step(self, coef: float | torch.Tensor = 1.0) -> None:
        """Apply held updates with gradients scaled by ``coef`` (a float, or a 0-dim device
        tensor computed on the device: ``clip_norms.device_coefficient``)."""
        for s in self._pending:
            self._update(s, coef)
        self._pending = []

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next updates."""
        for opts in self._optims.values():
            for _, _, opt in opts:
                opt.param_groups[0]["lr"] = lr

    def sync_steps_from_shadows(self, shadows: list[UnitShadow]) -> None:
        """Take step counts from the shadows (after loading a checkpoint)."""
        for s in shadows:
            if s.unit.index in self._optims:
                for _, _, opt in self._optims[s.unit.index]:
                    p = opt.param_groups[0]["params"][0]
                    opt.state[p]["step"].fill_(float(s.step))

    def _update(self, s: UnitShadow, coef: float | torch.Tensor) -> None:
        held = self._held.pop(s.unit.index, None)
        if held is not None:  # upcast now, one unit at a time
            self.backend.realloc_storage(s.grad)
            for view, g in zip(s.train_slices(s.grad), held):
                view.copy_(g)
            del held
        if isinstance(coef, torch.Tensor) or coef != 1.0:
            s.grad.mul_(coef)  # a tensor's value is not known here: times 1 changes no bit
        for a, b, opt in self._optims[s.unit.index]:
            p = opt.param_groups[0]["params"][0]
            p.grad = s.grad[a:b]
            opt.step()
            p.grad = None
        self.backend.keep_alive(s.grad, self.backend.current_stream())
        self.backend.free_storage(s.grad)  # 4 bytes per parameter held only while updating
        s.write_back()
        s.step += 1
