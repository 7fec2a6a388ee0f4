"""Data parallelism for MemFerry: one engine per rank (one device each), one model.

Each rank trains on its own micro-batch. Per unit, once backward has produced its gradient:
the gradient is summed over ranks (``all_reduce`` on the device's collective library: NCCL,
HCCL, gloo) and averaged; each rank copies to the host only *its shard* of it (1/world of the
unit's elements), updates only that shard of the fp32 master and moments with the host AdamW,
writes the shard of the compute-dtype working copy, and the ranks then exchange shards so every
rank's working copy is whole again for the next forward. Host optimizer work and host memory
for masters and moments are split ``world`` ways.

Two process groups of MemFerry's own keep the collectives of two threads apart: gradients are
reduced from the training thread (on the caller's collective library), weight shards gathered
from the host optimizer's thread (gloo); each thread issues its collectives in the same order
on every rank. Both are bounded by ``XPU_COLLECTIVE_TIMEOUT_S`` (:func:`xpu.dist.collective_timeout`),
whatever timeout the caller's group has: a rank that stops makes the others fail with a message
naming the group, never wait for gloo's 30-minute default.

Loading weights to the device, each rank copies only its shard host->device and the ranks
all-gather the rest device to device, so every rank's host link carries 1/world of each unit
(ScaleUp-MemFerry's multi-path idea under data parallelism: the peers are the other paths).
A rank's host working copy then needs only its own shard current; the host-side exchange of
shards remains only for units read in place by DHA.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xpu.dist import collective_timeout

__all__ = ["DataParallel", "CollectiveTimeoutError"]


from xpu.errors import CollectiveTimeoutError  # noqa: E402  (re-exported: MemFerry's name for it)


#: How to change the bound, for messages.
XPU_TIMEOUT_HINT = "XPU_COLLECTIVE_TIMEOUT_S sets it"


@dataclass
class DataParallel:
    """Rank, world size and the two process groups of a data-parallel MemFerry.

    Attributes:
        rank: this process's rank in ``grad_group``.
        world: number of ranks.
        grad_group: group for device-side gradient reduction (the caller's collective library).
        weight_group: gloo group for host-side exchange of updated weight shards.
        device: where ``grad_group`` collectives put their tensors.
    """

    rank: int
    world: int
    grad_group: Any
    weight_group: Any
    device: torch.device
    timeout: datetime.timedelta = datetime.timedelta(minutes=5)
    ranks: tuple[int, ...] = ()

    @classmethod
    def create(cls, device: torch.device, group: Any = None) -> "DataParallel | None":
        """Set up from ``group`` (default: the whole world); None when there is one rank.

        Every rank must call this at the same point (it creates a process group).

        Raises:
            RuntimeError: torch.distributed is not initialised.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("data-parallel MemFerry needs torch.distributed initialised (init_process_group) first")
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world == 1:
            return None
        ranks = dist.get_process_group_ranks(group)
        timeout = collective_timeout()
        # Our own groups, so the bound holds whatever the caller's default group was made with.
        grad_group = dist.new_group(ranks, backend=dist.get_backend(group), timeout=timeout)
        # host tensors: gloo handles them on any device
        weight_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        return cls(dist.get_rank(group), world, grad_group, weight_group, device, timeout, tuple(ranks))

    def _failed(self, what: str, exc: BaseException) -> CollectiveTimeoutError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CollectiveTimeoutError(
            f"data-parallel MemFerry, rank {self.rank} of ranks {list(self.ranks)}: {what} did not complete within "
            f"{self.timeout.total_seconds():.0f} s ({XPU_TIMEOUT_HINT}): a peer rank stopped or died ({first[:300]})")

    def shard(self, numel: int) -> tuple[int, slice]:
        """The padded length (a multiple of ``world``) and this rank's slice of a flat unit."""
        padded = -(-numel // self.world) * self.world
        size = padded // self.world
        return padded, slice(self.rank * size, (self.rank + 1) * size)

    def average(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over ranks in place and divide by the world size.

        Raises:
            CollectiveTimeoutError: a peer did not take part within the timeout.
        """
        try:
            dist.all_reduce(flat, group=self.grad_group)
        except RuntimeError as exc:  # gloo's and NCCL's timeouts (DistBackendError is a RuntimeError)
            raise self._failed("a gradient all-reduce", exc) from exc
        flat.div_(self.world)

    def all_sum(self, value: float) -> float:
        """Sum a scalar over ranks (gradient norms for clipping); training thread only.

        Raises:
            CollectiveTimeoutError: a peer did not take part within the timeout.
        """
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(t, group=self.grad_group)
        except RuntimeError as exc:
            raise self._failed("the gradient-norm all-reduce", exc) from exc
        return float(t.item())

    def all_gather_async(self, flat: torch.Tensor) -> Any:
        """Start filling every rank's shard of device tensor ``flat`` (padded to a multiple of
        ``world``) from its owner, in place, over the device group (NCCL over NVLink, not the
        host link). Returns the collective's handle: its ``wait()`` orders the current stream
        after the gather (and blocks the host only on gloo). Training thread only."""
        size = flat.numel() // self.world
        mine = flat[self.rank * size:(self.rank + 1) * size]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        try:
            return _Bounded(gather(flat, mine, group=self.grad_group, async_op=True), self, "a weight all-gather")
        except RuntimeError as exc:
            raise self._failed("a weight all-gather", exc) from exc

    def gather(self, full: torch.Tensor) -> None:
        """Fill every rank's shard of host tensor ``full`` from its owner (in place)."""
        size = full.numel() // self.world
        shards = list(full.split(size))
        mine = shards[self.rank].clone()
        try:
            dist.all_gather(shards, mine, group=self.weight_group)
        except RuntimeError as exc:
            raise self._failed("a weight-shard all-gather", exc) from exc


@dataclass
class _Bounded:
    """A collective's handle whose ``wait`` says which collective of which ranks did not complete."""

    work: Any
    dp: DataParallel
    what: str

    def wait(self) -> Any:
        """Wait as the handle does; a timeout becomes :class:`CollectiveTimeoutError`."""
        try:
            return self.work.wait()
        except RuntimeError as exc:
            raise self.dp._failed(self.what, exc) from exc
