"""Runs a plan: loads, binds, frees and offloads each unit around its use.

Forward: before a block runs, its weights are made available in the planned mode (waiting
for a prefetch already in flight, or binding the device view of host memory for DHA) and
the next units' loads are issued on the host→device stream. After it runs, a prefetched
unit's device memory is given back (kept when backward will need it soon).
Backward: a hook on each block's output fires before the block's backward (and before any
recomputation): the unit is loaded or bound for backward and the earlier units' loads are
issued. When a unit's last gradient has accumulated, its gradients go to host memory on the
device→host stream and the host optimizer is told; the device memory of weights and gradients
is given back.

Activation offload (``UnitPlan.offload``): inside the block's forward, what autograd saves is
swapped into pinned host memory on a side stream (``strategies/activation_swap.py``, shared with
MPress); when backward reaches the block, its activations and the next block's are brought
back ahead of use.

DHA blocks: the large ``nn.Linear`` layers of a block whose forward mode is ``dha`` run as
:func:`~strategies.memferry.dha_linear.host_linear` (each weight byte crosses the link once
per pass at any batch size, instead of once per GEMM tile), and their weight gradients are
written by the device straight into the unit's host gradient buffer (no device copy, no
device→host copy). The choice follows the forward mode in both passes, because a
recomputation must run the same operations as the forward it replays. Other parameters of
a DHA block (norms, biases) are read in place through the device view.

Gradient accumulation: on a backward that is not the step's last micro-batch, gradients go
home as always but the host optimizer only sums them (no update, so the host copy stays
current and the next forward does not wait); a unit planned ``accumulate="device"`` sums them
in an fp32 device buffer instead and sends the sum home once, on the last micro-batch
(``device_accumulation.py``). Frozen units are released after the next unit's backward hook
(the input gradient through a frozen weight can follow the last trainable gradient).

All ordering is by events: the compute stream waits for loads, the copy streams wait for
compute; the host only waits for the optimizer before reading a unit's working copy.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from scaleup.handles import Transfer
from xpu import Backend

from ..activation_swap import ActivationSwapper, SwapGroup
from ..selective_recompute import selective_checkpoint
from .clip_norms import GlobalNormClip
from .compiled_blocks import compile_forward, compiles
from .config import OFFLOAD_MIN_BYTES, Plan, UnitPlan
from .device_accumulation import DeviceSums
from .device_optimizer import DeviceOptimizer
from .dha_linear import TransferCounter, host_linear
from .grad_post import GradientPost
from .grads_home import GradientsHome
from .host_optimizer import HostOptimizer
from .plan_check import check_plan
from .shadow import ShadowModel, UnitShadow

__all__ = ["Executor", "DHA_LINEAR_MIN_BYTES"]

#: Linear weights smaller than this stay on the plain path in DHA blocks (read in place): the
#: streamed op's fixed costs (events, a copy per chunk) outweigh moving a few kilobytes.
DHA_LINEAR_MIN_BYTES = 64 << 10


class Executor(GradientsHome):
    """Hooks a model's units and moves their weights and gradients per the plan (gradients:
    :class:`~.grads_home.GradientsHome`).

    Args:
        backend: the xpu backend.
        device: device index.
        shadow: the units' buffers.
        plan: a plan for every block unit.
        optimizer: the host optimizer fed with host-homed units' gradients.
        device_optimizer: updates the device-homed units.
        copier: a :class:`scaleup.MultiPathCopier` to this device: weight loads go through it,
            split over the direct host link and relays through peer devices (ScaleUp-MemFerry);
            None: one copy on the host→device stream.
        accumulation_steps: micro-batches per optimizer step (``UnitPlan.accumulate="device"`` needs > 1).
        clip: global-norm clipping (``clip_norms.py``): the units in its ``device_normed`` add their
            step gradient's squares to its device sum before the gradient goes home, and bring the
            running sum home behind it (``GlobalNormClip.partials``). None: no clipping.
        compile_blocks: run each block that can through ``torch.compile`` (``compiled_blocks.py``).
    """

    def __init__(self, backend: Backend, device: int, shadow: ShadowModel, plan: Plan, optimizer: HostOptimizer,
                 device_optimizer: DeviceOptimizer, copier: Any = None, accumulation_steps: int = 1,
                 clip: GlobalNormClip | None = None, compile_blocks: bool = False) -> None:
        blocks = [s for s in shadow.shadows if s.unit.is_block]
        check_plan(plan, len(blocks), backend, accumulation_steps)
        self.b, self.dev, self.shadow, self.plan, self.opt = backend, device, shadow, plan, optimizer
        self.copier = copier
        self.device_opt = device_optimizer
        self.blocks = blocks
        self.rest = shadow.shadows[-1]
        self.unit_plans: dict[int, UnitPlan] = {s.unit.index: plan.units[i] for i, s in enumerate(blocks)}
        self.unit_plans[self.rest.unit.index] = UnitPlan("resident", "resident", optimizer=plan.rest_optimizer)
        self.sums = DeviceSums(backend, device, [s for s in blocks if s.home == "host" and s.unit.trainable
                                                 and self.unit_plans[s.unit.index].accumulate == "device"])
        self.h2d = backend.stream(device)
        self.d2h = backend.stream(device)
        self.phase = "idle"
        # unit index -> event marking its device copy complete (None once the compute stream waited on it)
        self._loaded: dict[int, Any] = {}
        self._stale: set[int] = set()  # host-homed units whose host copy will change (an update is queued)
        self._zone: dict[int, int] = {}  # paired units: the landing zone (0, 1) of their next micro-batch
        self._pending_grads: dict[int, int] = {}
        self._param_unit: dict[int, tuple[UnitShadow, int]] = {}
        self._handles: list[Any] = []
        self.bytes_h2d = 0
        self.post = GradientPost(backend, device, self.d2h, optimizer, clip)
        #: traffic of DHA blocks' streamed linears (weights in, gradients written home)
        self.dha_counter = TransferCounter()
        self._routed: dict[int, set[int]] = {}  # unit index -> ids of weights whose gradient host_linear writes
        self._routed_done: set[int] = set()  # ... of those, the ones written this step
        self._final = True  # the current backward is the step's last micro-batch
        self._frozen_in_backward: list[UnitShadow] = []  # frozen units whose backward ran (to release)
        self.compile_blocks = compile_blocks  # blocks through torch.compile where they can (compiled_blocks.py)
        # Activation offload. Weights are never swapped: they are bound to buffers that come and go.
        self.swapper = ActivationSwapper(backend, device, min_bytes=OFFLOAD_MIN_BYTES)
        self.swapper.skip = self._keeps_on_device  # type: ignore[method-assign]
        self._swap_groups: dict[int, SwapGroup] = {}
        self._last_swap_group: SwapGroup | None = None
        self._install()

    # ------------------------------------------------------------------ set-up
    def _install(self) -> None:
        for s in self.shadow.shadows:
            for _, p in s.unit.trainable:  # frozen parameters get no gradient, so no hook
                self._param_unit[id(p)] = (s, 0)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for s in self.blocks:
            module = s.unit.module
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, s)))
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, s)))
            if s.home == "host" and self.unit_plans[s.unit.index].forward == "dha":
                self._route_linears(s)
            up = self.unit_plans[s.unit.index]
            compiled = self.compile_blocks and compiles(up)
            if up.selective or up.recompute or up.offload or compiled:
                self._handles.append(_Restore(module))  # taken before the wraps below
            if compiled:  # inside any recomputation: it recomputes through the compiled graph
                compile_forward(module)
            if up.selective:
                module.forward = functools.partial(selective_checkpoint, module.forward)
            elif up.recompute:
                module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
            elif up.offload:
                module.forward = functools.partial(self._offloaded, s, module.forward)
        for s in [self.rest] + [s for s in self.blocks if self.unit_plans[s.unit.index].forward == "resident"]:
            if s.home == "host":  # a device-homed unit's buffer is its home, allocated already
                self.b.realloc_storage(s.device_flat, self.dev)

    def _route_linears(self, s: UnitShadow) -> None:
        """Send the unit's large linears through ``host_linear`` (see the module docstring)."""
        # Trainable weights only: a frozen one stays on the plain path (read in place by DHA).
        position = {id(p): k for k, (_, p) in enumerate(s.unit.trainable)}
        weights = s.slices(s.work)
        # Under data parallelism the host gradient buffer holds only this rank's shard: the
        # gradient must come to the device to be averaged first.
        grads = s.train_slices(s.grad_stage) if self.shadow.dp is None else None
        routed = self._routed.setdefault(s.unit.index, set())
        for m in s.unit.module.modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            k = position.get(id(m.weight))
            if k is None or m.weight.numel() * m.weight.element_size() < DHA_LINEAR_MIN_BYTES:
                continue
            if grads is not None:
                routed.add(id(m.weight))
            self._handles.append(_Restore(m))  # before the wrap: it puts back what was there
            m.forward = functools.partial(self._dha_linear, s, m, weights[k], grads[k] if grads is not None else None)

    def _dha_linear(self, s: UnitShadow, m: torch.nn.Linear, weight_host: torch.Tensor,
                    grad_host: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        ready = functools.partial(self._on_host_grad, s, m.weight) if grad_host is not None else None
        return host_linear(x, weight_host, m.bias, self.b, self.dev, grad_out=grad_host, weight=m.weight,
                           grad_ready=ready, counter=self.dha_counter)

    def _offloaded(self, s: UnitShadow, forward: Any, *args: Any, **kwargs: Any) -> Any:
        if self.phase != "forward" or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        group = SwapGroup("host", self._last_swap_group)
        self._swap_groups[s.unit.index] = group
        self._last_swap_group = group
        with self.swapper.hooks(group):
            return forward(*args, **kwargs)

    def _keeps_on_device(self, t: torch.Tensor) -> bool:
        """Saved tensors offload leaves alone: small ones, and any unit's weights."""
        if t.numel() * t.element_size() < self.swapper.min_bytes or isinstance(t, torch.nn.Parameter):
            return True
        ptr = t.untyped_storage().data_ptr()
        return any(ptr in (u.device_flat.untyped_storage().data_ptr(),
                           u.dha_flat.untyped_storage().data_ptr() if u.dha_flat is not None else -1)
                   for u in self.shadow.shadows)

    def _on_host_grad(self, s: UnitShadow, weight: torch.Tensor, event: Any) -> None:
        # host_linear wrote this weight's gradient into the host buffer (complete when the
        # compute stream passes `event`, which the gradient offload's own event follows).
        self._routed_done.add(id(weight))
        self._count_grad(weight)

    def close(self) -> None:
        """Remove hooks and routings (the model keeps its parameters as they are bound), and drop
        what a step cut short may still hold: its saved activations hold hooks that hold this
        executor, a cycle through autograd's graph that the garbage collector cannot see. Copies in
        flight are waited for first: their host buffers go back to the arena next (reused, unpinned)."""
        self.b.synchronize(self.dev)
        for h in reversed(self._handles):  # wrappers unwound last-on first-off
            h.remove()
        self._handles.clear()
        self._swap_groups.clear()
        self._last_swap_group = None
        self._loaded.clear()
        self._frozen_in_backward = []
        self.sums.discard(self.compute)

    @property
    def bytes_d2h(self) -> int:
        """Bytes of gradients sent home so far."""
        return self.post.bytes

    # ------------------------------------------------------------------ step boundaries
    @property
    def compute(self) -> Any:
        """The stream the model's kernels run on."""
        return self.b.current_stream(self.dev)

    def begin_forward(self) -> None:
        """Refresh resident copies and start the first loads."""
        self.phase = "forward"
        self._pending_grads = {s.unit.index: len(s.unit.trainable) for s in self.shadow.shadows}
        self._frozen_in_backward = []
        self._routed_done.clear()
        self._swap_groups.clear()
        self._final = True
        self._last_swap_group = None
        self._use(self.rest, "resident")
        upcoming = [s for s in self.blocks if self.unit_plans[s.unit.index].forward != "dha"]
        for s in upcoming[: self.plan.prefetch_depth]:
            self._issue_load(s)

    def invalidate_device_copies(self) -> None:
        """Host copies changed outside the optimizer (a checkpoint load): reload before use."""
        for s in self.shadow.shadows:
            if s.home == "host":
                self._release(s)  # prefetched copies go; resident ones stay allocated ...
                self._stale.add(s.unit.index)  # ... and are reloaded before their next use

    def begin_backward(self, final: bool = True) -> None:
        """Backward starts: the hooks switch to backward modes. ``final``: this backward ends
        the step's gradient (its last micro-batch), so updates start as gradients land;
        otherwise gradients are only accumulated."""
        self.phase = "backward"
        self._final = final

    def flush_updates(self) -> None:
        """The step ends before its last micro-batch: the accumulated updates run now (device sums
        go home first), so every host-homed unit's copy will change (reload before use)."""
        for index in self.sums.open_units():
            self._send_sum(self.shadow.shadows[index])
        self._zone.clear()  # the next step's first micro-batch lands in the first zone
        for s in self.shadow.shadows:
            if s.home == "host" and s.unit.trainable:
                self._stale.add(s.unit.index)

    def end_backward(self) -> None:
        """Backward ended: offload units whose gradients did not all arrive (unused parameters)."""
        for s in self.shadow.shadows:
            if self._pending_grads.get(s.unit.index):
                routed = self._routed.get(s.unit.index, set())
                if routed:  # a skipped backward: the optimizer may still read the last micro-batch's grad there
                    self.opt.wait_consumed(s.unit.index)
                for (_, p), host_grad in zip(s.unit.trainable, s.train_slices(s.grad_stage)):
                    if id(p) in routed:
                        if id(p) not in self._routed_done:
                            host_grad.zero_()  # written by host_linear when used; unused: zero
                    elif p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._pending_grads[s.unit.index] = 0
                self._offload_grads(s)
        for s in self.blocks:  # units with frozen parameters are released here at the latest
            if len(s.unit.trainable) < len(s.unit.params) and self.unit_plans[s.unit.index].backward != "dha":
                self._release(s)
        self._frozen_in_backward = []
        self.phase = "idle"

    # ------------------------------------------------------------------ loading and binding
    def _issue_load(self, s: UnitShadow) -> None:
        index = s.unit.index
        if s.home == "device" or (index in self._loaded and index not in self._stale):
            return  # device-homed units are updated in place; a current copy needs no reload
        self._stale.discard(index)
        self.opt.wait(index)  # the working copy must hold the latest update before it is read
        with self.b.device_scope(self.dev):
            if self.unit_plans[index].forward != "resident":
                # Allocate from the compute stream's pool, where activations live too: a block
                # allocated on the copy stream could later serve only that stream, and the
                # device would hold both pools (reserved memory far above what is in use).
                self.b.realloc_storage(s.device_flat, self.dev)
            # Under data parallelism this rank brings only its shard over the host link; the
            # ranks all-gather the rest device to device (data_parallel.py).
            dp = self.shadow.dp
            dst, src = (s.device_flat[s.shard], s.work[s.shard]) if dp is not None else (s.device_flat, s.work)
            if self.copier is not None:
                # Split over routes by the copier's threads; it fences after the compute stream itself.
                ready: Any = self.copier.copy(dst, src)
            else:
                allocated = self.b.event()
                allocated.record(self.compute)
                self.h2d.wait_event(allocated)
                self.b.copy(dst, src, self.h2d)
                ready = self.b.event()
                ready.record(self.h2d)
            if dp is not None:
                # Queued from the copy stream: the gather follows this shard's copy, not compute.
                with self.b.use_stream(self.h2d):
                    if isinstance(ready, Transfer):  # the copier's chunks ran on its own streams
                        ready.wait(self.h2d)
                    ready = _Gathered(dp.all_gather_async(s.device_flat))
        self.bytes_h2d += dst.numel() * dst.element_size()
        self._loaded[index] = ready

    def _use(self, s: UnitShadow, mode: str) -> None:
        index = s.unit.index
        if s.home == "device":  # updated in place on the compute stream: always current
            s.bind(s.device_views)
            return
        if mode == "dha":
            self.opt.wait(index)
            s.bind(s.dha_views)
            return
        self._issue_load(s)  # no-op when a prefetch (or a current resident copy) is there already
        self._wait_loaded(self._loaded[index])
        self._loaded[index] = None  # the compute stream is past it: a later use or release need not wait
        s.bind(s.device_views)

    def _wait_loaded(self, ready: Any) -> None:
        """Order the compute stream after a unit's load (None: it is already)."""
        if ready is None:
            return
        if isinstance(ready, Transfer):
            ready.wait(self.compute)  # a multi-path transfer: the stream waits for its last chunk
        elif isinstance(ready, _Gathered):
            ready.work.wait()  # the current (compute) stream waits for the ranks' all-gather
        else:
            self.compute.wait_event(ready)

    def _release(self, s: UnitShadow) -> None:
        if self.unit_plans[s.unit.index].forward == "resident" or s.unit.index not in self._loaded:
            return
        # A load never used (a frozen prefix's block: backward skips it) may still be writing;
        # one that was used has had the compute stream wait on it already.
        self._wait_loaded(self._loaded[s.unit.index])
        self.b.keep_alive(s.device_flat, self.compute)
        self.b.free_storage(s.device_flat)
        del self._loaded[s.unit.index]

    def _order(self, s: UnitShadow, backward: bool) -> list[UnitShadow]:
        """The blocks after ``s`` in the current pass's order."""
        i = self.blocks.index(s)
        return list(reversed(self.blocks[:i])) if backward else self.blocks[i + 1:]

    def _prefetch_after(self, s: UnitShadow, backward: bool) -> None:
        issued = 0
        for nxt in self._order(s, backward):
            if issued >= self.plan.prefetch_depth:
                break
            mode = self.unit_plans[nxt.unit.index].backward if backward else self.unit_plans[nxt.unit.index].forward
            if mode == "dha":
                continue
            self._issue_load(nxt)
            issued += 1

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, s: UnitShadow, module: torch.nn.Module, args: Any) -> None:
        if self.phase != "forward":
            return  # a recomputation inside backward: the backward hook already bound the unit
        self._use(s, self.unit_plans[s.unit.index].forward)
        self._prefetch_after(s, backward=False)

    def _post_forward(self, s: UnitShadow, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.phase != "forward":
            return
        plan = self.unit_plans[s.unit.index]
        # The last few blocks run backward right after forward: keep what backward reloads anyway.
        soon = self.blocks.index(s) >= len(self.blocks) - self.plan.prefetch_depth
        if plan.forward == "prefetch" and not (soon and plan.backward == "prefetch"):
            self._release(s)
        tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            tensors[0].register_hook(functools.partial(self._pre_backward, s))

    def _pre_backward(self, s: UnitShadow, grad: torch.Tensor) -> None:
        if s.home == "host" and s.unit.index in self._routed:
            self.opt.wait_consumed(s.unit.index)  # host_linear writes this micro-batch's gradient home
        # The backward of a unit with frozen parameters before this one is done (it produced
        # this gradient). Its gradient offload cannot release its weights: the input gradient
        # through a frozen weight may still be computed after the last trainable gradient lands.
        for done in self._frozen_in_backward:
            self._release(done)
        self._frozen_in_backward = []
        self._use(s, self.unit_plans[s.unit.index].backward)
        if len(s.unit.trainable) < len(s.unit.params) and self.unit_plans[s.unit.index].backward != "dha":
            self._frozen_in_backward.append(s)
        self._prefetch_after(s, backward=True)
        group = self._swap_groups.pop(s.unit.index, None)
        if group is not None:  # this block's offloaded activations, and the next block's (look-ahead)
            self.swapper.prefetch(group, lookahead=1)


class _Gathered:
    """A load completed by an all-gather over the ranks (its collective handle)."""

    def __init__(self, work: Any) -> None:
        self.work = work


class _Restore:
    """Undo a wrapped module's ``forward`` (a handle like the hooks', for :meth:`Executor.close`):
    back to what it was (its own attribute or the class's), so a rebuilt engine does not keep
    the last plan's recomputation or offload around its blocks (``rehearsal.py``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._before = module.__dict__.get("forward")

    def remove(self) -> None:
        if self._before is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._before
