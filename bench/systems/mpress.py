"""MPress as a benchmarked system (``xpu bench`` name ``mpress``).

The worker process that runs the system does not train itself: the constructor spawns one
persistent stage process per pipeline stage (``torch.multiprocessing``, spawn start method),
each on device ``rank``, joined in a process group of the backend's collective library. Every
stage builds the scenario's model from the scenario's seed, keeps its own stage
(:class:`~strategies.mpress.pipeline.StageRuntime`: stage split, profiling and planning,
peer pools), and owns a ``torch.optim.AdamW`` over its parameters with the scenario's
hyper-parameters. :meth:`MPressSystem.step` hands the batch to the first stage (inputs) and the
last (targets), waits for every stage to finish its forward, backward and optimizer step, and
returns the mean of the last stage's micro-batch losses (the mean over the batch, as the
``torch`` system reports it).

Device memory lives in the stage processes, out of sight of the worker's allocator
statistics: the row's peak device column is left empty and the notes carry each stage's
peak (allocated since the end of set-up, so profiling and planning are not counted).

Options:
    stages: pipeline depth (one process and one device per stage; at most the model's blocks).
    microbatches: micro-batches per step (must divide the batch; 1F1B needs at least ``stages``).
    schedule: ``"1f1b"`` or ``"gpipe"``.
    plan: ``"auto"`` (profile one step, then the planner picks keep/recompute/host/peer per block
        under the scenario's device cap, applied to every stage's device), ``"recompute"`` (the same
        planner allowed only recomputation: the recompute-only baseline) or ``"keep"`` (no offload).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .base import BenchSystem, SystemContext, phase
from .rank_pool import RankChannel, RankPool

from xpu.dist import collective_timeout
from strategies.mpress.pipeline import SCHEDULES, PipelineJob, adamw_with_states

__all__ = ["MPressSystem", "make", "PLANS"]

#: Values of the ``plan`` option.
PLANS = ("auto", "recompute", "keep")
_GB = 1e9
#: Seconds to wait for the stages' set-up (process start, model build, profiling, planning).
_SETUP_TIMEOUT_S = float(os.environ.get("MPRESS_BENCH_SETUP_TIMEOUT_S", "600"))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mpress: option '{name}' must be a positive integer, got {value!r}")
    return value


def build_job(ctx: SystemContext) -> tuple[PipelineJob, int]:
    """The pipeline job and stage count described by ``ctx``'s options.

    Every check happens here, before any process starts.

    Raises:
        ValueError: a bad option, a family that cannot be split, more stages than blocks or
            devices, or micro-batches that do not divide the batch.
    """
    opts = ctx.options
    stages = _positive_int("stages", opts["stages"])
    microbatches = _positive_int("microbatches", opts["microbatches"])
    schedule, plan = opts["schedule"], opts["plan"]
    if schedule not in SCHEDULES:
        raise ValueError(f"mpress: option 'schedule' must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if plan not in PLANS:
        raise ValueError(f"mpress: option 'plan' must be one of {', '.join(PLANS)}, got {plan!r}")
    if ctx.family not in ("gpt", "llama"):
        raise ValueError(f"mpress: model family {ctx.family!r} cannot be split into stages (gpt and llama can)")
    if ctx.batch % microbatches:
        raise ValueError(f"mpress: batch {ctx.batch} does not split into {microbatches} equal micro-batches "
                         f"(option 'microbatches' must divide the batch)")
    layers = int(ctx.dims["layers"])
    if stages > layers:
        raise ValueError(f"mpress: {stages} stages need at least {stages} blocks; the model has {layers} "
                         f"(lower option 'stages' or raise model.layers)")
    if not ctx.backend.caps.virtual_devices and ctx.backend.device_count() < stages:
        raise ValueError(f"mpress: {stages} stages need {stages} devices; backend '{ctx.backend.name}' "
                         f"has {ctx.backend.device_count()}")
    cap = ctx.backend.memory_cap(ctx.device_index)
    job = PipelineJob(dims=dict(ctx.dims), family=ctx.family, schedule=schedule, microbatches=microbatches,
                      batch=ctx.batch, steps=1, seed=ctx.seed, plan=plan,
                      budgets={r: int(cap) for r in range(stages)} if cap else None, dtype=ctx.dtype)
    try:
        job.validate(stages)
    except ValueError as exc:
        raise ValueError(f"mpress: {exc}") from None
    return job, stages


class MPressSystem(BenchSystem):
    """A pipeline of persistent stage processes driven one training step per :meth:`step` call.

    Args:
        ctx: the scenario; options ``stages``, ``microbatches``, ``schedule``, ``plan``.

    Raises:
        ValueError: bad options (before any process starts).
        RuntimeError: a stage failed during set-up (its traceback in the message).
        torch.OutOfMemoryError: a stage ran out of device memory, or no plan fits the cap.
    """

    tracks_device_memory = False  # the memory is in the stage processes, not in this one

    def __init__(self, ctx: SystemContext) -> None:
        self.job, self.stages = build_job(ctx)
        self._pool: RankPool | None = None
        self._peaks: list[int | None] = [None] * self.stages
        self._plan_text = ""
        # The cpu backend's virtual devices: one per stage at least (None elsewhere).
        env = ctx.backend.env_for_device_count(max(self.stages, ctx.backend.device_count())) or {}
        self._pool = RankPool("mpress", "stage", self.stages, _stage_main,
                              args=(self.job, ctx.adamw_kwargs(), ctx.backend.dist_backend), env=env,
                              setup_timeout_s=_SETUP_TIMEOUT_S)
        ready = self._pool.ready
        self._plan_text = ready[0].get("plan_text", "")
        if self._plan_text and self.job.plan != "keep":
            print(f"mpress plan:\n{self._plan_text}", flush=True)
        self._decisions = {r: ready[r].get("decisions", {}) for r in range(self.stages)}

    @property
    def notes(self) -> str:  # type: ignore[override]
        """Options, per-stage decisions (plan ``auto``) and per-stage peak device memory."""
        job = self.job
        text = f"stages={self.stages} microbatches={job.microbatches} schedule={job.schedule} plan={job.plan}"
        moved = {r: d for r, d in getattr(self, "_decisions", {}).items() if any(v != "keep" for v in d.values())}
        if moved:
            text += "; decisions " + " ".join(
                f"s{r}:{','.join(f'b{b}={v}' for b, v in sorted(d.items()))}" for r, d in sorted(moved.items()))
        if any(p is not None for p in self._peaks):
            text += "; peak device GB per stage: " + " ".join(
                f"s{r}={p / _GB:.4f}" if p is not None else f"s{r}=?" for r, p in enumerate(self._peaks))
        return text

    @property
    def stage_peaks(self) -> list[int | None]:
        """Each stage's peak allocated device bytes since set-up ended (None before the first step)."""
        return list(self._peaks)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One pipelined training step of the batch across all stages; the mean micro-batch loss."""
        with phase("pipeline"):
            host_in = inputs.detach().to("cpu").contiguous()
            host_tgt = targets.detach().to("cpu").contiguous()
            last = self.stages - 1
            # The first stage needs the inputs, the last the targets; the others get activations from peers.
            replies = self._pool.run("step", [(host_in if rank == 0 else None, host_tgt if rank == last else None)
                                              for rank in range(self.stages)])
        for rank, info in replies.items():
            self._peaks[rank] = info["peak"]
        return torch.tensor(replies[last]["loss"], dtype=torch.float32)

    def close(self) -> None:
        """Stop the stage processes (politely, then by force) and release their queues."""
        if self._pool is not None:
            self._pool.close()


def _stage_main(channel: RankChannel, job: PipelineJob, adamw: dict[str, Any], dist_backend: str) -> None:
    """Body of one stage process: set up, then serve ``step`` commands until ``stop`` (or the parent is gone)."""
    rank, world = channel.rank, channel.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import xpu

    from strategies.mpress.planner import InfeasibleBudgetError
    from strategies.mpress.stage_setup import setup_stage

    runtime = None
    try:
        backend = xpu.get_backend()
        channel.take_device(backend)
        channel.init_process_group(dist_backend, collective_timeout(300.0).total_seconds())
        box: list[torch.optim.Optimizer] = []

        def prepare(stage: torch.nn.Module) -> None:
            box.append(adamw_with_states(stage, adamw))

        runtime = setup_stage(job, rank, world, backend, prepare=prepare)  # raises InfeasibleBudgetError
        optimizer = box[0]
        runtime.apply_cap()
        channel.reply("ready", {"plan_text": runtime.result.get("plan_text", ""),
                                "decisions": {b: str(d) for b, d in runtime.decisions.items()}})
        for _, (idx, tgt) in channel.serve():
            with backend.device_scope(rank):
                idx = backend.to_device(idx, rank) if idx is not None else None
                tgt = backend.to_device(tgt, rank) if tgt is not None else None
                runtime.stage.zero_grad(set_to_none=True)
                losses = runtime.step(idx, tgt)
                optimizer.step()
                loss = float(torch.stack([l.float() for l in losses]).mean()) if losses else None
                del idx, tgt, losses
                backend.synchronize(rank)
            channel.reply("step", {"loss": loss, "peak": backend.memory_stats(rank).peak_allocated})
        if not channel.orphaned:  # closing is collective (a barrier): not with peers that may be gone
            runtime.close()
    except BaseException as exc:
        # A planner that finds no plan under the cap is this system's out-of-memory.
        channel.fail(exc, oom_types=(InfeasibleBudgetError,))
    finally:
        channel.leave_process_group()


def make(ctx: SystemContext) -> MPressSystem:
    """Factory registered as ``mpress``."""
    return MPressSystem(ctx)
