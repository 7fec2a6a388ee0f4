"""Where a unit's gradients go once its backward has made the last of them (the executor's side).

A device-homed unit's go to the device optimizer. A host-homed unit's go home on the
device→host stream and are submitted to the host optimizer (``grad_post.py``): into its landing
zone, where a paired unit's micro-batches alternate between two zones so the host sums them two
at a time (``landing_zones.py``); under data parallelism first averaged over the ranks on the
device, only this rank's shard brought home. A unit summing on the device (``accumulate="device"``)
adds each micro-batch to its fp32 device sum and sends the sum home once, on the step's last
micro-batch (``device_accumulation.py``). Gradients that ``host_linear`` already wrote home (a DHA
block's linears) are counted, not sent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .shadow import UnitShadow

if TYPE_CHECKING:
    from xpu import Backend

    from .config import UnitPlan
    from .device_accumulation import DeviceSums
    from .device_optimizer import DeviceOptimizer
    from .grad_post import GradientPost
    from .host_optimizer import HostOptimizer
    from .shadow import ShadowModel

__all__ = ["GradientsHome"]


class GradientsHome:
    """The executor's gradient hooks (``Executor`` inherits them): count each parameter's
    gradient, and once a unit has all of them, send them where the plan says (see the module).
    Reads the executor's attributes annotated here."""

    b: "Backend"
    dev: int
    shadow: "ShadowModel"
    opt: "HostOptimizer"
    device_opt: "DeviceOptimizer"
    sums: "DeviceSums"
    post: "GradientPost"
    d2h: Any
    unit_plans: dict[int, "UnitPlan"]
    _param_unit: dict[int, tuple[UnitShadow, int]]
    _routed: dict[int, set[int]]
    _pending_grads: dict[int, int]
    _zone: dict[int, int]
    _stale: set[int]
    _final: bool
    _release: Callable[[UnitShadow], None]

    def _on_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient has accumulated (its hook): count it."""
        s, _ = self._param_unit[id(param)]
        if id(param) in self._routed.get(s.unit.index, ()):
            # Counted when host_linear wrote it home. Under recomputation autograd still runs the
            # weight's accumulate step (with no gradient), which would count it twice.
            return
        self._count_grad(param)

    def _count_grad(self, param: torch.Tensor) -> None:
        """One gradient fewer for its unit to wait for; the unit's last sends them all."""
        s, _ = self._param_unit[id(param)]
        index = s.unit.index
        self._pending_grads[index] -= 1
        if self._pending_grads[index] == 0:
            self._offload_grads(s)

    def _offload_grads(self, s: UnitShadow) -> None:
        """Unit ``s`` has all its gradients of this micro-batch: send them where the plan says."""
        dp = self.shadow.dp
        if s.home == "device":
            with self.b.device_scope(self.dev):
                self.device_opt.grads_ready(s, reduce=dp.average if dp is not None else None, final=self._final)
            return
        if s in self.sums:  # summed on the device: nothing goes home before the last micro-batch
            with self.b.device_scope(self.dev):
                self.sums.add(s)
            if self._final:
                self._send_sum(s)
        else:
            # Micro-batches of a paired unit alternate between its two zones (summed two at a time).
            zone = self._zone.get(s.unit.index, 0) if s.grad_stage2 is not None else 0
            self.opt.wait_consumed(s.unit.index, zone)  # what landed there before is summed: the zone is free
            if s.grad_stage2 is not None:
                self._zone[s.unit.index] = 0 if self._final else 1 - zone
            if dp is None:
                routed = self._routed.get(s.unit.index, set())  # already home: host_linear wrote them
                stage = s.grad_stage2 if zone else s.grad_stage
                pairs = [(p.grad, t) for (_, p), t in zip(s.unit.trainable, s.train_slices(stage))
                         if id(p) not in routed]
                sources, targets = [g for g, _ in pairs], [t for _, t in pairs]
            else:
                # Average the unit's trainable gradients over ranks on the device, then bring home
                # only this rank's shard: the host optimizer updates that shard alone (frozen
                # parameters have no gradient to reduce; a rank whose shard is all frozen brings none).
                with self.b.device_scope(self.dev):
                    flat = self.b.empty(s.unit.train_numel, s.grad_stage.dtype, self.dev)
                    for view, (_, p) in zip(s.train_slices(flat), s.unit.trainable):
                        view.copy_(p.grad)
                    dp.average(flat)
                sources, targets = [flat[s.train_shard]], [s.grad_stage]
            self._send_home(s, sources, targets, self._final, zone=zone)
            for _, p in s.unit.trainable:
                p.grad = None
        if self.unit_plans[s.unit.index].backward != "dha" and len(s.unit.trainable) == len(s.unit.params):
            self._release(s)  # (a unit with frozen parameters is released by the next unit's backward hook)

    def _send_sum(self, s: UnitShadow) -> None:
        """Copy a device-summed unit's complete fp32 sum (averaged over ranks, once) into its
        ``grad_acc`` and submit it as the step's gradient; the buffer is given back."""
        self.opt.wait(s.unit.index)  # grad_acc is the previous update's input until that update is published
        dp = self.shadow.dp
        with self.b.device_scope(self.dev):
            total = self.sums.total(s, dp.average if dp is not None else None)
        self._send_home(s, [total], [s.grad_acc], final=True, summed=True)
        self.sums.release(s, self.d2h)

    def _send_home(self, s: UnitShadow, sources: list[torch.Tensor], targets: list[torch.Tensor], final: bool,
                   summed: bool = False, zone: int = 0) -> None:
        """Send gradients home and submit them (``grad_post.py``)."""
        if final:
            self._stale.add(s.unit.index)  # its update is about to change the host copy
        self.post.send(s.unit.index, sources, targets, final, summed, zone)
