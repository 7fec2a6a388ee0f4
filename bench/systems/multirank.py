"""Data-parallel baselines: any single-process system run once per rank behind one harness row.

The baselines (``fsdp2-offload``, the DeepSpeed systems) are written for one process. Their
option ``ranks`` (default 1: that one process, unchanged) asks for ``ranks`` persistent rank
processes instead (a :class:`~bench.systems.rank_pool.RankPool`), rank ``r`` on device ``r``,
joined in one process group of the backend's collective library (``nccl`` on CUDA, ``hccl``
on Ascend, ``gloo`` on the cpu backend). Every rank runs the system's own single-process
factory with that group already up, so the system spans the whole world without a second
implementation: FSDP2 builds its mesh over ``dist.get_world_size()`` ranks, DeepSpeed finds
the group and the launch variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) that each rank sets for itself.

A system opts in with :func:`per_rank` on its factory::

    @per_rank("fsdp2-offload")
    def make(ctx): ...            # the single-process factory, called as before when ranks == 1

and registers ``"ranks": 1`` among its options. Inside a rank the factory sees ``ranks == 1``
(it is one member of the world, not the starter of another pool) and the rank's own device,
micro-batch and seed.

**Batch.** As for ``memferry-dp``, the scenario's ``batch`` is the *global* batch: it is split
into ``ranks`` equal micro-batches, rank ``r`` training on rows ``r*b .. (r+1)*b-1``
(``b = batch / ranks``; a batch that does not divide is refused). The row's loss is the mean
of the ranks' micro-batch losses, which for equal micro-batches is the loss over the whole
batch; the systems average gradients over ranks, so in fp32 a multi-rank row trains like the
single-process row on the same global batch.

**Memory.** Device memory lives in the rank processes, out of this process's sight: the row's
peak device column is left empty (``tracks_device_memory = False``) and the notes carry each
rank's peak allocated bytes since the start of its set-up (as the single-process worker counts
them), where the system's own device memory is tracked at all. The scenario's device cap
applies to every rank's device; the host budget of our pinned arena (``XPU_HOST_MEM_BUDGET``)
is split evenly between the ranks, which share one host, and so are the CPU threads.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .base import BenchSystem, SystemContext, phase
from .rank_pool import DataParallelRows, RankChannel, RankPool, mean_loss, rank_env, peaks_text

__all__ = ["MultiRankSystem", "RankJob", "per_rank", "ranks_option", "Factory"]

#: A system's factory: takes a context, returns a system ready to step.
Factory = Callable[[SystemContext], BenchSystem]

#: Seconds to wait for every rank's set-up (process start, model build, engine set-up).
_SETUP_TIMEOUT_S = float(os.environ.get("XPU_BENCH_RANKS_SETUP_TIMEOUT_S", "600"))
#: Seconds any collective may wait: a rank that dies must not leave its peers waiting forever.
_PG_TIMEOUT_S = float(os.environ.get("XPU_BENCH_RANKS_PG_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class RankJob:
    """What every rank process needs to build its system (picklable: it crosses the spawn).

    Attributes:
        name: the registered system name (first word of messages).
        target: ``"module:callable"`` of the factory each rank calls (with ``ranks == 1``).
        ranks: world size.
        family, dims, dtype, seq, optimizer, seed: the scenario's model, dtype, sequence length,
            AdamW settings and seed.
        micro_batch: one rank's batch (the scenario's global batch / ranks).
        options: the system's options as the rank's factory sees them (``ranks`` set to 1).
        device_cap: each rank's device cap in bytes (None: the whole device).
        dist_backend: the backend's collective library (``gloo``, ``nccl``, ``hccl``).
        accumulation_steps: micro-batches per optimizer step (each rank's step gets its rows of each).
    """

    name: str
    target: str
    ranks: int
    family: str
    dims: dict[str, Any]
    dtype: torch.dtype
    micro_batch: int
    seq: int
    optimizer: dict[str, Any]
    seed: int
    options: dict[str, Any] = field(default_factory=dict)
    device_cap: int | None = None
    dist_backend: str = "gloo"
    accumulation_steps: int = 1


def ranks_option(name: str, ctx: SystemContext) -> int:
    """The validated ``ranks`` option of ``ctx`` (1 when the options do not carry it).

    Raises:
        ValueError: not an integer, or less than 1.
    """
    ranks = ctx.options.get("ranks", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise ValueError(f"{name}: option 'ranks' must be an integer >= 1, got {ranks!r}")
    if ranks < 1:
        raise ValueError(f"{name}: option 'ranks' must be at least 1 (one process per device), got {ranks}")
    return ranks




def _require_packages(name: str) -> None:
    """Raise ModuleNotFoundError for the first package the registered system ``name`` needs and lacks.

    Checked here, before any rank starts, so that the row reads "missing" (the harness files a
    ModuleNotFoundError so), not "error" with a rank's traceback.
    """
    from . import registered_systems

    spec = registered_systems().get(name)
    for package in spec.requires if spec is not None else ():
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ModuleNotFoundError(f"No module named '{package}' (needed by {name})", name=package)


def _plan(name: str, target: str, ctx: SystemContext, ranks: int) -> tuple[RankJob, dict[str, str]]:
    """The job every rank runs and the rank processes' environment additions.

    Every check happens here, before any process starts.

    Raises:
        ValueError: more ranks than devices, or a batch that does not split into ``ranks``
            equal micro-batches.
    """
    backend = ctx.backend
    env = rank_env(name, backend, ranks, ctx.batch)
    cap = backend.memory_cap(ctx.device_index)
    job = RankJob(name=name, target=target, ranks=ranks, family=ctx.family, dims=dict(ctx.dims), dtype=ctx.dtype,
                  micro_batch=ctx.batch // ranks, seq=ctx.seq, optimizer=dict(ctx.optimizer), seed=ctx.seed,
                  options={**ctx.options, "ranks": 1}, device_cap=int(cap) if cap else None,
                  dist_backend=backend.dist_backend, accumulation_steps=ctx.accumulation_steps)
    return job, env


class MultiRankSystem(DataParallelRows, BenchSystem):
    """``ranks`` persistent rank processes, each running the factory ``target`` over the whole world.

    Args:
        name: the registered system name (messages, process names).
        target: ``"module:callable"`` of a single-process factory; each rank calls it with
            ``ranks == 1``, its own device and its micro-batch, after joining the process group.
        ctx: the scenario (the global batch, options with ``ranks``).

    Raises:
        ValueError: bad ``ranks`` option, too few devices, or a batch not divisible by ``ranks``
            (all before any process starts).
        ModuleNotFoundError: a package the system requires is not installed (before any process starts).
        RuntimeError: a rank failed during set-up or a step (its traceback in the message).
        torch.OutOfMemoryError: a rank ran out of memory.
    """

    tracks_device_memory = False  # the memory is in the rank processes, not in this one

    def __init__(self, name: str, target: str, ctx: SystemContext) -> None:
        self.name = name
        self.ranks = ranks_option(name, ctx)
        self.job, env = _plan(name, target, ctx, self.ranks)
        _require_packages(name)
        self._pool: RankPool | None = None
        self._peaks: list[int | None] = [None] * self.ranks
        self._tracked = False
        self._inner_notes = ""
        self._pool = RankPool(name, "rank", self.ranks, _rank_main, args=(self.job,), env=env,
                              setup_timeout_s=_SETUP_TIMEOUT_S)
        ready = self._pool.ready[0]
        # Rank 0 speaks for all: every rank built the same system.
        self.optimizer_on_host = bool(ready["optimizer_on_host"])
        self._tracked = bool(ready["tracked"])
        self._inner_notes = ready["notes"]

    @property
    def notes(self) -> str:  # type: ignore[override]
        """Ranks and micro-batch, the system's own notes (rank 0's) and each rank's peak device memory."""
        job = self.job
        text = f"ranks={job.ranks} (micro-batch {job.micro_batch} per rank)"
        if self._inner_notes:
            text += f"; {self._inner_notes}"
        if any(p is not None for p in self._peaks):
            text += peaks_text(self._peaks)
        elif not self._tracked and "not tracked" not in self._inner_notes:  # FSDP2 on cpu says so itself
            text += "; per-rank device memory not tracked"
        return text


    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One data-parallel step of the whole batch; returns the mean of the ranks' losses.

        Rank ``r`` trains on rows ``r*b .. (r+1)*b-1`` of the batch (``b = batch / ranks``).
        """
        with phase("data-parallel"):
            replies = self._step_ranks(inputs, targets, self.job.micro_batch, self.job.accumulation_steps)
        self._inner_notes = replies[0]["notes"]  # a system may say more once it has stepped
        return mean_loss(replies, self.ranks)

    def close(self) -> None:
        """Stop the rank processes (politely, then by force) and release their queues."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def per_rank(name: str, check: Callable[[SystemContext], None] | None = None) -> Callable[[Factory], Factory]:
    """Decorate a single-process factory so that its option ``ranks`` > 1 runs it data-parallel.

    With ``ranks == 1`` (or no ``ranks`` option) the decorated factory is the plain one. With more,
    it returns a :class:`MultiRankSystem` whose ranks each call the decorated factory (by its
    module path, with ``ranks == 1``).

    Args:
        name: the registered system name.
        check: validates the system's other options in this process, so a bad one is refused
            before any rank starts (the factory checks them again in each rank).
    """

    def wrap(factory: Factory) -> Factory:
        target = f"{factory.__module__}:{factory.__name__}"

        @functools.wraps(factory)
        def make(ctx: SystemContext) -> BenchSystem:
            if ranks_option(name, ctx) == 1:
                return factory(ctx)
            if check is not None:
                check(ctx)
            return MultiRankSystem(name, target, ctx)

        return make

    return wrap


def _load(target: str) -> Factory:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _rank_main(channel: RankChannel, job: RankJob) -> None:
    """Body of one rank process: join the group, build the system, serve ``step`` until ``stop``."""
    rank = channel.rank
    world = str(job.ranks)
    # The worker set the one-process launch variables (rank 0 of 1); DeepSpeed reads all of these
    # (without them it falls back to MPI discovery), FSDP2's mesh LOCAL_RANK for the device.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(channel.port))
    # The ranks share one host: split its cores between them rather than oversubscribe.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.ranks))
    import xpu

    system = None
    try:
        backend = xpu.get_backend()
        channel.take_device(backend)
        if job.device_cap:
            backend.set_memory_cap(rank, job.device_cap)
        factory = _load(job.target)
        ctx = SystemContext(backend=backend, device_index=rank, family=job.family, dims=dict(job.dims),
                            dtype=job.dtype, batch=job.micro_batch, seq=job.seq, optimizer=dict(job.optimizer),
                            options=dict(job.options), seed=job.seed, accumulation_steps=job.accumulation_steps)
        with backend.device_scope(rank):
            # Joined inside the device scope: NCCL binds its communicator to the current device.
            channel.init_process_group(job.dist_backend, _PG_TIMEOUT_S)
            backend.reset_peak_memory(rank)  # as the worker does: the peak covers set-up and training
            torch.manual_seed(job.seed)  # as the worker seeds before a single-process factory: same model
            system = factory(ctx)
            backend.synchronize(rank)
        tracked = bool(getattr(system, "tracks_device_memory", True))
        channel.reply("ready", {"notes": str(getattr(system, "notes", "")), "tracked": tracked,
                                "optimizer_on_host": bool(getattr(system, "optimizer_on_host", False))})
        for _, (idx, tgt) in channel.serve():
            with backend.device_scope(rank):
                idx = backend.to_device(idx, rank)
                tgt = backend.to_device(tgt, rank)
                loss = system.step(idx, tgt)
                value = float(loss)  # waits for this rank's device work
                del loss, idx, tgt
                backend.synchronize(rank)
            channel.reply("step", {"loss": value, "notes": str(getattr(system, "notes", "")),
                                   "peak": backend.memory_stats(rank).peak_allocated if tracked else None})
        if not channel.orphaned:  # a system's close may be collective: not with peers that may be gone
            system.close()
    except BaseException as exc:
        channel.fail(exc)
    finally:
        channel.leave_process_group()
