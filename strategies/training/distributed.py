"""``xpu train`` under ``torchrun``: one rank per device, data-parallel, one model.

torchrun (``--nproc_per_node N``, several nodes through its own rendezvous) sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in each process it starts.
:func:`join` reads them: each rank trains on device ``LOCAL_RANK`` of the backend and joins the
default process group on the backend's collective library (gloo on the cpu backend), bounded by
``XPU_COLLECTIVE_TIMEOUT_S`` (:func:`xpu.dist.collective_timeout`). The strategy (MemFerry)
then runs data-parallel over that group.

The config's ``batch`` is per rank: every rank draws the same global batch of ``WORLD_SIZE x
batch`` rows from the one seeded data source (so its position, saved in checkpoints, is every
rank's) and trains on its own ``batch`` rows of it (:meth:`Launch.shard`). N ranks with ``batch:
B`` therefore train as one process with ``batch: N*B``. Losses are averaged over the ranks;
only rank 0 reports and writes checkpoints (the state it writes is the whole model: MemFerry
gathers the shards on every rank).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .config import TrainConfigError

__all__ = ["Launch", "join", "torchrun_env"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def torchrun_env() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` when torchrun started this process with several ranks, else None.

    Raises:
        TrainConfigError: one of the variables is set but not a whole number in range.
    """
    raw = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if raw["WORLD_SIZE"] in (None, "", "1"):
        return None
    try:
        rank, world, local = (int(raw[k] if raw[k] is not None else "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise TrainConfigError(f"torchrun's environment is incomplete or not numeric (RANK={raw['RANK']!r}, "
                               f"WORLD_SIZE={raw['WORLD_SIZE']!r}, LOCAL_RANK={raw['LOCAL_RANK']!r}); start xpu "
                               f"train with torchrun, or unset WORLD_SIZE to run one process") from None
    if not 0 <= rank < world or local < 0:
        raise TrainConfigError(f"torchrun's environment is inconsistent: RANK={rank}, WORLD_SIZE={world}, "
                               f"LOCAL_RANK={local}")
    return rank, world, local


@dataclass
class Launch:
    """This process's place in a torchrun job.

    Attributes:
        rank, world: global rank and number of ranks.
        device: the backend device this rank trains on (``LOCAL_RANK``).
        owns_group: whether :func:`join` made the default process group (then :meth:`close` destroys it).
    """

    rank: int
    world: int
    device: int
    owns_group: bool

    @property
    def leader(self) -> bool:
        """Whether this rank reports and writes checkpoints (rank 0)."""
        return self.rank == 0

    def shard(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of a global ``(inputs, targets)`` batch (equal shares, in rank order).

        Raises:
            ValueError: the rows do not split evenly over the ranks.
        """
        x, y = batch
        rows = x.shape[0]
        if rows % self.world:
            raise ValueError(f"a batch of {rows} rows does not split over {self.world} ranks; give batches whose "
                             f"row count is a multiple of WORLD_SIZE")
        per = rows // self.world
        return x[self.rank * per:(self.rank + 1) * per], y[self.rank * per:(self.rank + 1) * per]

    def mean(self, value: Any, device: torch.device) -> float:
        """The mean of a scalar over the ranks (a collective: every rank calls it at the same point)."""
        import torch.distributed as dist

        t = torch.as_tensor(value, dtype=torch.float32).detach().reshape(1).to(device, copy=True)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def close(self) -> None:
        """Leave the process group if :func:`join` made it."""
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def join(backend: Any, strategy: str, data_parallel: bool) -> Launch | None:
    """Under torchrun with several ranks: check the device, join the process group; else None.

    Everything is checked before the group is joined. An already initialised default group
    (a caller that made its own) is used as it is and left to the caller.

    Raises:
        TrainConfigError: the strategy cannot train data-parallel, ``LOCAL_RANK`` names no
            device of the backend, or the group's size differs from ``WORLD_SIZE``.
    """
    env = torchrun_env()
    if env is None:
        return None
    rank, world, local = env
    if not data_parallel:
        raise TrainConfigError(f"strategy: {strategy} does not train data-parallel, and under torchrun (WORLD_SIZE="
                               f"{world}) every rank would train its own copy: use strategy: memferry, or run one "
                               f"process")
    devices = sorted(d.index for d in backend.topology().devices)
    if local not in devices:
        raise TrainConfigError(f"LOCAL_RANK={local} names no device: the {backend.name} backend has "
                               f"{len(devices)} device(s) ({', '.join(map(str, devices))}); start at most "
                               f"--nproc_per_node {len(devices)} processes per node")
    import torch.distributed as dist

    from xpu.dist import collective_timeout

    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise TrainConfigError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE={world}")
        owns = False
    else:
        if os.environ.get("MASTER_ADDR", "127.0.0.1") in _LOOPBACK:
            # one machine: gloo's pair sockets on loopback too, not on the hostname's address
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend.bind_process(local)  # NCCL/HCCL stage collective objects on the current device
        dist.init_process_group(backend.dist_backend, rank=rank, world_size=world, timeout=collective_timeout())
        owns = True
    return Launch(rank, world, local, owns)
