"""Data-parallel MemFerry as a benchmarked system (``xpu bench`` name ``memferry-dp``).

The worker process that runs the system does not train itself: the constructor spawns one
persistent rank process per rank (``torch.multiprocessing``, spawn start method), rank ``r``
on device ``r``, joined in a process group of the backend's collective library (gloo on the
cpu backend, NCCL on CUDA, HCCL on Ascend). Every rank builds the scenario's model from the
scenario's seed and hands it to its own :class:`~strategies.memferry.engine.MemFerry` engine
with that process group, so gradients are averaged across ranks and the host optimizer (fp32
masters and moments) is sharded by rank (see ``data_parallel.py``).

**Accumulation.** With ``accumulation_steps`` N each rank runs its rows of each of the N
micro-batches (forward, ``backward(loss / N)``) and one ``step()``: one update per N.

**Batch.** The scenario's ``batch`` is the *global* batch: it is split into ``ranks`` equal
micro-batches, rank ``r`` training on rows ``r*b .. (r+1)*b-1`` (``b = batch / ranks``; the
batch must divide evenly). So a ``memferry-dp`` row trains on the same data as the ``torch``
and ``memferry`` rows of the same scenario, its tokens per second count every rank's tokens,
and the loss it reports, the mean of the ranks' micro-batch losses, is the loss over the whole
batch (the micro-batches are equal, so the mean of their means is the mean over all tokens):
in fp32 it matches a single-process run on the whole batch. To benchmark a fixed per-rank
batch ``b``, write ``batch: ranks * b`` in the scenario.

Device memory lives in the rank processes, out of sight of the worker's allocator statistics:
the row's peak device column is left empty and the notes carry each rank's peak (allocated
since the end of set-up, so the scheduler's profiling for plan ``auto`` is not counted). The
scenario's device cap applies to every rank's device; its host cap (the pinned arena's
budget) is split evenly between the ranks, which share one host. Host memory of the rank
processes is counted in the row by the worker (it samples its descendants).

Options:
    ranks: number of ranks (one process and one device each); at least 2 (one rank is the
        ``memferry`` system) and at most the backend's device count (the cpu backend gets as
        many virtual devices as ranks, unless ``XPU_CPU_TOPOLOGY`` or a per-device
        ``XPU_CPU_DEVICE_MEM`` list fixes their number).
    plan: as ``memferry``'s: a :meth:`~strategies.memferry.config.Plan.from_spec` name or
        ``auto``. With ``auto``, rank 0 profiles one micro-batch and the scheduler picks the plan
        under the scenario's device cap; every rank then uses that one plan (ranks that chose
        separately could home different units on the device, and their collectives would not
        line up).
    max_grad_norm: global-norm clipping over the averaged gradient (None: off).
    clip_mode: ``speculative`` or ``wait`` (as ``memferry``'s).
    loss_chunks: compute the loss over this many token slices (see ``bench/systems/memferry.py``).
    host_threads, host_kernel, memory_margin: as ``memferry``'s. Without ``host_threads``
        each rank's torch uses ``cpu_count // ranks`` threads, so the ranks do not
        oversubscribe the host they share.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .base import BenchSystem, SystemContext, phase
from .host_rate import host_metrics, host_note
from .rank_pool import DataParallelRows, RankChannel, RankPool, mean_loss, rank_env, peaks_text

from strategies.memferry import AdamW, Plan

__all__ = ["MemFerryDPSystem", "DPJob", "build_job", "make"]

#: Seconds to wait for the ranks' set-up (process start, model build, profiling for plan auto).
_SETUP_TIMEOUT_S = float(os.environ.get("MEMFERRY_DP_SETUP_TIMEOUT_S", "600"))
_NAME = "memferry-dp"


@dataclass(frozen=True)
class DPJob:
    """What every rank process needs to build its engine (picklable: it crosses the spawn).

    Attributes:
        ranks: world size.
        family, dims, dtype, seed: the scenario's model, compute dtype and seed.
        micro_batch, seq: one rank's micro-batch shape.
        plan: a plan name for :meth:`Plan.from_spec`, or ``"auto"``.
        optim: the AdamW settings (validated in the parent).
        loss_chunks: sliced-loss count (1: off).
        memory_margin: scheduler margin for plan ``auto``.
        device_cap: each rank's device cap in bytes (None: the whole device).
        dist_backend: the backend's collective library name (``gloo``, ``nccl``, ``hccl``).
        accumulation_steps: micro-batches per optimizer step (``MemFerry(accumulation_steps=...)``).
    """

    ranks: int
    family: str
    dims: dict[str, Any]
    dtype: torch.dtype
    seed: int
    micro_batch: int
    seq: int
    plan: str
    optim: AdamW
    loss_chunks: int
    memory_margin: float
    device_cap: int | None
    dist_backend: str
    accumulation_steps: int = 1




def build_job(ctx: SystemContext) -> tuple[DPJob, dict[str, str]]:
    """The job every rank runs and the environment additions of the rank processes.

    Every check happens here, before any process starts.

    Raises:
        ValueError: a bad option (fewer than 2 ranks, more ranks than devices, a batch that
            does not split into equal micro-batches, an unknown plan, bad optimizer settings).
    """
    from strategies.models import build_model

    opts = ctx.options
    ranks = opts["ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise ValueError(f"{_NAME}: option 'ranks' must be an integer >= 2, got {ranks!r}")
    if ranks < 2:
        raise ValueError(f"{_NAME}: option 'ranks' must be at least 2, got {ranks}; "
                         f"for one device use the 'memferry' system")
    backend = ctx.backend
    env = rank_env(_NAME, backend, ranks, ctx.batch)
    # The meta model allocates nothing; it gives the block count and whether sliced loss is supported.
    meta = build_model(ctx.family, device="meta", **ctx.dims)
    chunks = opts["loss_chunks"]
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or \
            (chunks > 1 and not hasattr(meta, "loss_chunks")):
        raise ValueError(f"{_NAME}: loss_chunks must be an integer >= 1 and needs a model with sliced-loss "
                         f"support, got {chunks!r}")
    plan = opts["plan"]
    if not isinstance(plan, str):
        raise ValueError(f"{_NAME}: option 'plan' must be a plan name or 'auto', got {plan!r}")
    if plan != "auto":
        try:
            Plan.from_spec(plan, len(meta.blocks))
        except ValueError as exc:
            raise ValueError(f"{_NAME}: {exc}") from None
    margin = opts["memory_margin"]
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
        raise ValueError(f"{_NAME}: memory_margin must lie in [0, 1), got {margin!r}")
    try:
        optim = AdamW(**ctx.adamw_kwargs(), max_grad_norm=opts["max_grad_norm"], host_threads=opts["host_threads"],
                      host_kernel=opts["host_kernel"], clip_mode=opts.get("clip_mode", "speculative"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_NAME}: {exc}") from None
    cap = backend.memory_cap(ctx.device_index)
    job = DPJob(ranks=ranks, family=ctx.family, dims=dict(ctx.dims), dtype=ctx.dtype, seed=ctx.seed,
                micro_batch=ctx.batch // ranks, seq=ctx.seq, plan=plan, optim=optim, loss_chunks=chunks,
                memory_margin=float(margin), device_cap=int(cap) if cap else None, dist_backend=backend.dist_backend,
                accumulation_steps=ctx.accumulation_steps)
    return job, env


class MemFerryDPSystem(DataParallelRows, BenchSystem):
    """Persistent rank processes, each with a data-parallel MemFerry engine, one step per :meth:`step`.

    Args:
        ctx: the scenario; options ``ranks``, ``plan``, ``max_grad_norm``, ``loss_chunks``,
            ``host_threads``, ``host_kernel``, ``memory_margin``.

    Raises:
        ValueError: bad options (before any process starts).
        RuntimeError: a rank failed during set-up or a step (its traceback in the message).
        torch.OutOfMemoryError: a rank ran out of device memory.
    """

    optimizer_on_host = True
    tracks_device_memory = False  # the memory is in the rank processes, not in this one

    def __init__(self, ctx: SystemContext) -> None:
        self.job, env = build_job(ctx)
        self.ranks = self.job.ranks
        self._backend = ctx.backend  # for the cached probe's host figures (metrics)
        self._pool: RankPool | None = None
        self._peaks: list[int | None] = [None] * self.ranks
        self._host_times: dict[str, float] = {}
        self._host_rate: tuple[float | None, float | None] = (None, None)
        self._steps = 0
        self._pool = RankPool(_NAME, "rank", self.ranks, _rank_main, args=(self.job,), env=env,
                              setup_timeout_s=_SETUP_TIMEOUT_S)
        ready = self._pool.ready
        self._kernel = ready[0]["kernel"]
        self._predicted = ready[0]["predicted_step_s"]
        if self.job.plan == "auto":
            print(f"memferry-dp plan chosen by the scheduler on rank 0 (used by every rank):\n{ready[0]['plan_text']}",
                  flush=True)

    @property
    def notes(self) -> str:  # type: ignore[override]
        """Ranks and micro-batch, the plan, each rank's peak device memory and rank 0's host optimizer times."""
        job = self.job
        text = (f"ranks={job.ranks} (micro-batch {job.micro_batch} per rank), plan={job.plan}, "
                f"host kernel {getattr(self, '_kernel', '?')}")
        if job.loss_chunks > 1:
            text += f", loss in {job.loss_chunks} slices (gradients in forward)"
        if job.plan == "auto" and getattr(self, "_predicted", None) is not None:
            text += f" (predicted {self._predicted:.3f} s)"
        text += peaks_text(self._peaks)
        if self._steps and self._host_times:
            phases = ", ".join(f"{k} {v * 1e3 / self._steps:.1f}" for k, v in self._host_times.items())
            text += f"; rank 0 host optimizer ms/step: {phases}{host_note(self.metrics)}"
        return text

    @property
    def metrics(self) -> dict[str, Any]:
        """Rank 0's host optimizer rate, the plan's and host memory's floor (:func:`.host_rate.host_metrics`)."""
        if not self._steps:
            return {}
        job = self.job
        return host_metrics(*self._host_rate, job.dtype, job.accumulation_steps,
                            job.optim.clip_mode if job.optim.max_grad_norm is not None else "", self._backend,
                            paired=False)  # ranks sum their shards one micro-batch at a time


    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One data-parallel training step of the whole batch; returns the mean of the ranks' losses.

        Rank ``r`` trains on rows ``r*b .. (r+1)*b-1`` of the batch (``b = batch / ranks``).
        """
        with phase("data-parallel"):
            replies = self._step_ranks(inputs, targets, self.job.micro_batch, self.job.accumulation_steps)
        self._steps += 1
        self._host_times = replies[0]["host_times"]
        self._host_rate = replies[0]["host_rate"]
        return mean_loss(replies, self.ranks)

    def close(self) -> None:
        """Stop the rank processes (politely, then by force) and release their queues."""
        if self._pool is not None:
            self._pool.close()


def _rank_main(channel: RankChannel, job: DPJob) -> None:
    """Body of one rank process: set up, then serve ``step`` commands until ``stop`` (or the parent is gone)."""
    rank = channel.rank
    # The worker set the one-process launch variables (rank 0 of 1) for single-process systems; say who we are.
    world = str(job.ranks)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    if job.optim.host_threads is None:
        # The ranks share one host: split its cores between them rather than oversubscribe.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.ranks))
    import torch.distributed as dist

    import xpu
    from strategies.models import build_model

    from strategies.memferry import MemFerry

    engine = None
    try:
        backend = xpu.get_backend()
        channel.take_device(backend)
        with backend.device_scope(rank):
            channel.init_process_group(job.dist_backend, float(os.environ.get("MEMFERRY_DP_PG_TIMEOUT_S", "300")))
            torch.manual_seed(job.seed)  # as the worker seeds before a single-process system's factory
            model = build_model(job.family, dtype=torch.float32, **job.dims)  # fp32 masters, as memferry's
            if job.loss_chunks > 1:
                model.loss_chunks = job.loss_chunks
            sample = None
            if job.plan == "auto":  # the engine profiles this micro-batch on rank 0 and shares the plan
                tokens = torch.randint(0, _vocab(job), (job.micro_batch, job.seq + 1),
                                       generator=torch.Generator().manual_seed(job.seed))
                sample = (tokens[:, :-1], tokens[:, 1:])
            plan = "auto" if job.plan == "auto" else Plan.from_spec(job.plan, len(model.blocks))
            engine = MemFerry(model, optim=job.optim, plan=plan, backend=backend, device=rank, sample=sample,
                              device_budget=job.device_cap, process_group=dist.group.WORLD,
                              memory_margin=job.memory_margin, compute_dtype=job.dtype, blocks=model.blocks,
                              accumulation_steps=job.accumulation_steps)
            backend.synchronize(rank)
            backend.reset_peak_memory(rank)  # peaks from here on: training, not set-up
        channel.reply("ready", {"kernel": engine.optimizer.kernel.name, "plan_text": engine.plan.describe(),
                                "predicted_step_s": engine.plan.predicted_step_s})
        n = job.accumulation_steps
        for _, (idx, tgt) in channel.serve():
            losses = []
            for x, y in zip(idx.chunk(n), tgt.chunk(n)):  # this rank's rows of each micro-batch
                loss = engine(x, y)
                engine.backward(loss / n if n > 1 else loss)
                losses.append(loss.detach().float())
            engine.step()
            value = float(torch.stack(losses).mean())  # waits for this rank's device work
            del loss, losses, idx, tgt, x, y
            backend.synchronize(rank)
            channel.reply("step", {"loss": value, "peak": backend.memory_stats(rank).peak_allocated,
                                   "host_times": dict(engine.optimizer.time_s), "host_rate": engine.host_rate()})
    except BaseException as exc:
        channel.fail(exc)
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        channel.leave_process_group()


def _vocab(job: DPJob) -> int:
    if job.family == "hf":  # from its config or folder
        from strategies.models.hf_config import hf_config_dict

        return int(hf_config_dict(job.dims).get("vocab_size", 256))
    return int(job.dims.get("vocab", 256))


def make(ctx: SystemContext) -> MemFerryDPSystem:
    """Factory registered as ``memferry-dp``."""
    return MemFerryDPSystem(ctx)
