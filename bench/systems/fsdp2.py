"""The ``fsdp2-offload`` system: PyTorch FSDP2 with ``CPUOffloadPolicy`` (docs/design.md §3 anchor 0.640 s).

Configured as docs/design.md §3 says: ``fully_shard`` on each block and on the root, with
``CPUOffloadPolicy()`` and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
fp32 parameters (sharded parameters, gradients and AdamW states live in pinned host
memory), fused AdamW stepping on the CPU, one process. The device type and the collective
backend come from the xpu backend (``nccl`` on CUDA, ``hccl`` on Ascend, ``gloo`` on the cpu
reference backend).

With option ``ranks`` > 1 the same set-up runs in ``ranks`` processes, one device each
(:mod:`bench.systems.multirank`): the mesh then spans the whole world, each rank holds its
shard of the parameters, gradients and AdamW states, and the scenario's batch is split
between the ranks.

Options:
    pin_memory: pin the offloaded shards (CPUOffloadPolicy's default; forced off on the cpu
        backend, which has no pinned memory in torch's sense).
    fused: fused AdamW (its CPU kernel).
    reshard_after_forward: free gathered parameters after forward (FSDP2's default).
    ranks: data-parallel processes, one device each (1: this process alone).
    recompute: activation checkpointing per block (:func:`~bench.systems.base.set_recompute`:
        HF models through their own ``gradient_checkpointing_enable``, non-reentrant), switched
        on before ``fully_shard`` as torch's FSDP2 tests compose the two; each block's
        recompute then all-gathers its parameters again in backward.

With ``accumulation_steps`` N > 1, a step runs N forward/backwards on ``loss / N``, then one
AdamW step. Every backward reduce-scatters and FSDP2 adds each micro-batch's gradient shard into
the offloaded one on the host (no ``set_requires_gradient_sync(False)``: that would keep whole
unsharded gradients on the device between micro-batches, against the device cap).
"""
from __future__ import annotations

import contextlib

import torch

from .base import BenchSystem, SystemContext, init_single_process_group, module_step, set_recompute
from .multirank import per_rank

__all__ = ["FSDP2OffloadSystem", "make"]


class FSDP2OffloadSystem(BenchSystem):
    """FSDP2 over the process group's mesh (one rank alone, or each rank of a multi-rank run)
    with parameters, gradients and optimizer states on the host."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext) -> None:
        backend = ctx.backend
        # On the cpu reference backend the "device" is host memory, and its virtual-device
        # tracker cannot follow FSDP2's DTensor storages (they are resized in place): run
        # untracked there, so the code path is exercised in CI, and say memory is not tracked.
        host_scope = getattr(backend, "host_scope", None)
        self._scope = host_scope if backend.caps.virtual_devices and host_scope else contextlib.nullcontext
        self.tracks_device_memory = not backend.caps.virtual_devices
        with self._scope():
            self._setup(ctx)

    def _setup(self, ctx: SystemContext) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        backend = ctx.backend
        # A no-op inside a multi-rank run, whose group is up already: the mesh spans its whole world.
        init_single_process_group(backend.dist_backend)
        mesh = init_device_mesh(backend.device_type, (dist.get_world_size(),))
        # fp32 parameters built on the host: with CPU offload the shards stay there.
        self.model = ctx.build_model(device="cpu", dtype=torch.float32)
        self.model.train()
        recompute = set_recompute(self.model, ctx.options["recompute"])  # before fully_shard wraps the blocks
        on_accelerator = not backend.caps.virtual_devices
        offload = CPUOffloadPolicy(pin_memory=bool(ctx.options["pin_memory"]) and on_accelerator)
        mp = MixedPrecisionPolicy(param_dtype=ctx.dtype, reduce_dtype=torch.float32)
        reshard = bool(ctx.options["reshard_after_forward"])
        if not len(self.model.blocks):
            raise ValueError("fsdp2-offload: the model exposes no blocks to shard")
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        # Grouped after fully_shard (the groups hold the sharded parameters): no decay for biases and norm weights.
        self.optimizer = torch.optim.AdamW(ctx.adamw_params(self.model), fused=bool(ctx.options["fused"]),
                                           **ctx.adamw_kwargs())
        self._accumulation = ctx.accumulation_steps
        self.notes = f"param_dtype={str(ctx.dtype).removeprefix('torch.')}, reduce_dtype=fp32, pin_memory={offload.pin_memory}"
        if recompute:
            self.notes += f", {recompute}"
        if not self.tracks_device_memory:
            self.notes += "; cpu backend: device memory not tracked"

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._scope():
            return self._step(inputs, targets)

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return module_step(self.model, self.optimizer, inputs, targets, accumulation=self._accumulation)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@per_rank("fsdp2-offload")
def make(ctx: SystemContext) -> BenchSystem:
    """Factory registered as ``fsdp2-offload`` (option ``ranks`` > 1: one process per device)."""
    return FSDP2OffloadSystem(ctx)
