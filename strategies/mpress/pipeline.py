"""The MPress pipeline runner: stage processes on one node over ``torch.distributed.pipelining``.

:func:`launch` spawns one process per stage (``torch.multiprocessing``, spawn start method);
each joins a process group of the backend's collective library (gloo on the cpu backend,
NCCL/HCCL on accelerators; gloo, with activations staged through the host, when the job's
``devices`` map puts two stages on one device: :func:`xpu.dist.p2p_library`) and runs the jobs it is given one after the other (so tests pay for
process start-up once). Under ``torchrun`` call :func:`run_jobs` directly from each rank.

A job (:class:`~strategies.mpress.job.PipelineJob`) runs the set-up steps of
:mod:`strategies.mpress.stage_setup`:

1. build: every stage process builds the same model from the same seed and keeps its own
   stage on its device: ``job.devices[rank]``, by default ``rank`` (:mod:`strategies.mpress.build`);
2. profile: optionally one measured iteration, every stage's profile gathered
   (:mod:`strategies.mpress.profiling`, :mod:`strategies.mpress.memory_profile`);
3. plan: on rank 0 (``plan="auto"``: :func:`~strategies.mpress.planner.plan_offload`; or a
   forced ``{stage: {block: decision}}``), broadcast with any infeasibility error;
4. run: peer pools opened and the plan's executor set (:mod:`strategies.mpress.runtime`);
5. measure: under a budget, one uncapped step checks the plan's peaks (stages sharing a device
   add up) and re-plans while a device overshoots; a plan the job gives is refused if it does not
   fit (:class:`~strategies.mpress.planner.PlanOverBudgetError`);

then applies the device budget as a memory cap (split between the stages that share a device,
:meth:`StageRuntime.cap`) and trains ``steps`` steps with the chosen
schedule (GPipe or 1F1B), recording losses, the last step's gradients, measured peaks and
executor statistics. :func:`~strategies.mpress.job.reference` runs the same job unpipelined.

The names this module had before the set-up was split into those modules are re-exported
here (``PipelineJob``, ``StageRuntime``, ``reference``, ``adamw_with_states``...).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any

import torch

from xpu.dist import collective_timeout, init_local_group, p2p_library, peer_failure, release_rendezvous, rendezvous_port
from xpu.errors import CollectiveTimeoutError

from .build import adamw_with_states, build_stage
from .job import PLANNED, PROFILE_MODES, SCHEDULES, PipelineJob, job_batch, reference
from .planner import InfeasibleBudgetError
from .profiling import profile_stages, schedule_inflight
from .runtime import StageRuntime
from .stage_setup import plan_and_run

__all__ = ["PipelineJob", "StageRuntime", "launch", "run_jobs", "reference", "SCHEDULES", "PROFILE_MODES", "PLANNED",
           "adamw_with_states", "schedule_inflight"]


def launch(jobs: list[PipelineJob], stages: int, *, env: dict[str, str] | None = None,
           timeout_s: float | None = None) -> list[list[dict[str, Any]]]:
    """Run ``jobs`` on a pipeline of ``stages`` processes; return ``results[job][rank]``.

    ``env`` is applied in each stage process before the backend is created (e.g.
    ``XPU_BACKEND=cpu``, ``XPU_CPU_DEVICES``). Every job is validated before any process starts.

    Raises:
        ValueError: a job is invalid for this pipeline.
        RuntimeError: a stage process failed (its traceback is in the message).
    """
    import torch.multiprocessing as mp

    if stages < 1:
        raise ValueError(f"need at least one stage, got {stages}")
    for job in jobs:
        job.validate(stages)
    maps = {tuple(job.device_of(s) for s in range(stages)) for job in jobs}
    if len(maps) > 1:  # the process group and each process's device are set once, for all jobs
        raise ValueError(f"the jobs of one launch must share one stage -> device map, got {sorted(maps)}; "
                         f"launch jobs with different devices separately")
    with tempfile.TemporaryDirectory(prefix="mpress-") as out:
        port = rendezvous_port()
        try:
            ctx = mp.start_processes(_stage_process, args=(stages, port, jobs, out, dict(env or {})),
                                     nprocs=stages, start_method="spawn", join=False)
            while not ctx.join(timeout_s):
                pass
        finally:  # a stage that failed leaves the rendezvous file behind; this process reserved it
            release_rendezvous(port)
        results = []
        for r in range(stages):
            results.append(torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False))
    return [[results[r][j] for r in range(stages)] for j in range(len(jobs))]


def _stage_process(rank: int, world: int, port: int, jobs: list[PipelineJob], out: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)  # stage processes share the cores; oversubscription only slows them
    import torch.distributed as dist

    import xpu

    backend = xpu.get_backend()
    devices = [jobs[0].device_of(r) for r in range(world)] if jobs else list(range(world))
    if devices[rank] < backend.device_count():  # else run_jobs refuses the map with its reason
        # This stage's device current for good: NCCL stages collective objects on the current device.
        backend.bind_process(devices[rank])
    # Stages sharing a device meet over the host library (the accelerator's refuses two ranks
    # on one device); a bounded timeout: a stage that dies (e.g. out of memory) must not leave
    # its peers waiting forever.
    init_local_group(p2p_library(backend.dist_backend, devices), rank, world, port,
                     collective_timeout(60.0).total_seconds())
    try:
        results = run_jobs(jobs, backend)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def run_jobs(jobs: list[PipelineJob], backend: Any = None) -> list[dict[str, Any]]:
    """Run ``jobs`` as this rank's stage (inside an initialised process group, e.g. under torchrun)."""
    import torch.distributed as dist

    import xpu

    backend = backend or xpu.get_backend()
    world = dist.get_world_size()
    for job in jobs:
        if job.devices is None and backend.device_count() < world:
            raise ValueError(f"{world} stages need {world} devices; backend '{backend.name}' has {backend.device_count()}")
        job.validate(world)
        job.check_devices(world, backend.device_count(), backend.name)
    rank = dist.get_rank()
    try:
        return [_run_job(job, rank, world, backend) for job in jobs]
    except Exception as exc:
        if not peer_failure(exc):
            raise
        raise _stage_missing(rank, world, exc) from exc


class _StepFailed(RuntimeError):
    """A stage's training step failed (after set-up): its peers there are its pipeline neighbours."""


def _stage_missing(rank: int, world: int, exc: BaseException) -> CollectiveTimeoutError:
    """The error of a stage whose peers stopped answering: it names the stages it waited for.

    In a step a stage waits on its pipeline neighbours; in set-up (profiles, plans, pool
    handles) on every other stage, so then the culprit is one of them.
    """
    from xpu.dist import TIMEOUT_ENV

    neighbours = [r for r in (rank - 1, rank + 1) if 0 <= r < world]
    in_step = isinstance(exc, _StepFailed)
    waited = neighbours if in_step else [r for r in range(world) if r != rank]
    first = next((line for line in str(exc.__cause__ or exc).splitlines() if line.strip()), type(exc).__name__)
    return CollectiveTimeoutError(
        f"MPress stage {rank} of {world}: {'a send/recv with' if in_step else 'a set-up collective with'} "
        f"stage(s) {waited} did not complete within the group's timeout ({TIMEOUT_ENV} sets it): "
        f"{'a neighbouring stage' if in_step else 'one of them'} stopped or died ({first.strip()[:300]})")


def _run_job(job: PipelineJob, rank: int, world: int, backend: Any) -> dict[str, Any]:
    """Set ``job``'s stage up step by step, train it ``job.steps`` steps and report (collective)."""
    built = build_stage(job, rank, world, backend)
    profiled = profile_stages(built)
    try:
        rt = plan_and_run(built, profiled)
    except InfeasibleBudgetError as exc:
        return {"rank": rank, "error": str(exc), "minimum": exc.minimum, "profile": profiled.own}
    stage, result = rt.stage, rt.result
    idx, tgt = job_batch(job)
    opt = torch.optim.SGD(stage.parameters(), lr=job.lr) if job.lr else None
    rt.apply_cap()
    losses: list[list[float]] = []
    try:
        for step in range(job.steps):
            stage.zero_grad(set_to_none=True)
            losses.append([float(l) for l in rt.step(idx, tgt)])
            if opt is not None and step < job.steps - 1:
                with backend.device_scope(rt.device):
                    opt.step()
    except Exception as exc:
        result["error"] = traceback.format_exc()
        # The other stages are blocked in send/recv with this one: fail the whole run with the
        # cause rather than let them time out on a collective.
        raise _StepFailed(f"stage {rank} failed in step {len(losses)}:\n{result['error']}\nplan:\n{result['plan_text']}") from exc
    finally:
        result["peak"] = backend.memory_stats(rt.device).peak_allocated
        result["cap"] = backend.memory_cap(rt.device)
        backend.set_memory_cap(rt.device, None)
    result["losses"] = losses
    result["grads"] = {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}
    result["stats"] = stage.executor.stats.as_dict()
    result["region_peak"] = {j: stage.executor.region_peak(j) for j in rt.regions}
    result["hosted_pool_bytes"] = sum(b.numel() for b in rt.owned)
    result["decisions"] = {b: str(d) for b, d in rt.decisions.items()}
    if job.plan in PLANNED and rt.plan is not None:  # device -> the planner's peak for its stages together
        result["predicted_device_peaks"] = rt.plan.device_peaks()
    # Everyone must be done writing into the pools before owners free them.
    rt.close()
    return result
