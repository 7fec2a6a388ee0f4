"""Profiling an MPress stage: one measured iteration before any plan, the planner's input.

:func:`profile_stages` (collective) profiles this rank's stage when its job needs a profile
(a planned job, or ``profile=True``) and gathers every stage's
:class:`~strategies.mpress.memory_profile.StageProfile`. The iteration keeps every block's
activations when the stage fits its device that way; a stage that would not is profiled with
every block host-swapped instead (the saved-tensor hooks still see each tensor's size), its
all-keep peak estimated (``profile_mode``, :data:`~strategies.mpress.job.PROFILE_MODES`).
Each profile also records every saved tensor (size, producer, consumer, when it was saved and
read: :class:`~strategies.mpress.executor.TensorRecord`) and the device's budget.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Any

from .build import BuiltStage
from .executor import StageExecutor
from .job import PLANNED
from .memory_profile import BlockProfile, StageProfile

__all__ = ["Profiled", "profile_stages", "profile_stage", "schedule_inflight", "PROFILE_HEADROOM"]

#: Fraction of a device's memory ``profile_mode="auto"`` leaves unused when it decides whether
#: a stage fits all kept (allocator fragmentation, and the estimate's own error).
PROFILE_HEADROOM = 0.05


@dataclass(frozen=True)
class Profiled:
    """What the profiling step found.

    Attributes:
        own: this stage's profile (None when the job takes none).
        stages: every stage's profile, by stage (all None when none was taken): the planner's input.
        choice: how ``profile_mode="auto"`` chose for this stage (``keep_peak_bound``, ``usable``,
            ``mode``); None under a forced mode or without a profile.
    """

    own: StageProfile | None
    stages: list[StageProfile | None]
    choice: dict[str, Any] | None = None


def profile_stages(built: BuiltStage) -> Profiled:
    """Profile this stage if its job needs it, and gather every stage's profile (collective)."""
    import torch.distributed as dist

    job = built.job
    own, choice = profile_stage(built) if job.plan in PLANNED or job.profile else (None, None)
    stages: list[Any] = [None] * built.world
    dist.all_gather_object(stages, own)
    return Profiled(own, stages, choice)


def profile_stage(built: BuiltStage) -> tuple[StageProfile, dict[str, Any] | None]:
    """Profile one iteration of this stage (see :data:`~strategies.mpress.job.PROFILE_MODES`); returns
    its :class:`StageProfile` and, under ``profile_mode="auto"``, how the mode was chosen.

    The first step also infers the schedule's shapes (an extra forward), so it is a
    warm-up and the second step is the profiled one. Under ``profile_mode="auto"`` the
    warm-up runs with every block host-swapped, which fits wherever anything does, and
    measures what keeping them would need: the profiled step then keeps every block if
    that fits this device (exact peak) and host-swaps them otherwise (estimated peak).
    Without this, a stage whose activations do not fit its device all kept would run out
    of memory in profiling, before the planner could offload anything.

    Only the profiled step records each saved tensor (the warm-up sums per block); every
    stage starts it after a barrier, its tensor times counted from there. The stage is left
    with an executor that keeps every block.
    """
    import torch.distributed as dist

    job, rank, backend, stage = built.job, built.rank, built.backend, built.stage
    device = built.device
    swap_all = {b: "host" for b in stage.block_ids}
    inflight_cap = schedule_inflight(job.schedule, job.microbatches, rank, built.world)
    mode = job.profile_mode
    choice = None

    def executor(kind: str) -> StageExecutor:
        return built.executor(swap_all if kind == "host" else {})

    stage.executor = executor("keep" if mode == "keep" else "host")
    stage.executor.profiling = mode == "auto"
    stage.executor.trace_tensors = False  # the warm-up needs per-block sums only
    gc.collect()
    backend.reset_peak_memory(device)
    built.trial_step()
    stage.zero_grad(set_to_none=True)
    if mode == "auto":
        # An upper bound of the all-keep peak: the swapped step's peak plus every in-flight
        # saved byte (counted per saved tensor, so shared ones more than once). The warm-up's
        # in-flight count includes shape inference's forward, which never runs backward: the
        # schedule's own count caps it.
        warm = _stage_profile(stage.executor, stage, device, 0, job.microbatches, "keep", inflight_cap)
        bound = backend.memory_stats(device).peak_allocated + warm.inflight * sum(b.saved_bytes for b in warm.blocks)
        free, _total = backend.mem_info(device)
        usable = free + backend.memory_stats(device).reserved  # what this process can reach on the device
        mode = "keep" if bound <= usable * (1 - PROFILE_HEADROOM) else "host"
        choice = {"keep_peak_bound": bound, "usable": usable, "mode": mode}
    stage.executor = executor(mode)
    stage.executor.profiling = True
    gc.collect()
    backend.reset_peak_memory(device)
    # Every stage starts its clock together, so tensor times read alike across stages.
    dist.barrier()
    stage.executor.restart_clock()
    built.trial_step()
    stage.executor.profiling = False
    budget = built.budgets.get(rank, backend.mem_info(device)[1])  # as the planner takes it
    profile = _stage_profile(stage.executor, stage, device, backend.memory_stats(device).peak_allocated,
                             job.microbatches, mode, budget=budget)
    stage.zero_grad(set_to_none=True)
    stage.executor = executor("keep")
    return profile, choice


def schedule_inflight(schedule: str, microbatches: int, rank: int, world: int) -> int:
    """Most micro-batches whose activations stage ``rank`` holds at once under ``schedule``.

    GPipe runs every forward before any backward; 1F1B lets stage ``r`` run ``world - r``
    forwards before its first backward.
    """
    if schedule == "gpipe":
        return microbatches
    return max(1, min(microbatches, world - rank))


def _stage_profile(executor: Any, stage: Any, device: int, peak: int, microbatches: int, mode: str = "keep",
                   inflight_cap: int | None = None, budget: int | None = None) -> StageProfile:
    """The stage's :class:`StageProfile` from ``executor``'s records; ``peak`` is the measured one on ``device``.

    With ``mode="host"`` every block was host-swapped, and ``peak_bytes`` estimates the
    all-keep peak in the planner's own terms: the measured peak, plus the saved bytes of the
    micro-batches in flight (what keeping them would hold), less the transient headroom the
    planner adds back for swapped blocks. So the planner predicts exactly the measured peak
    for the plan that swaps every block, the one this iteration ran.

    The tensor records of the micro-batches that ran backward are numbered 0, 1, ... in
    forward order (the micro-batch order of both schedules).
    """
    blocks = []
    saved = []
    for i in stage.block_ids:
        # Only micro-batches that ran backward (the stage's shape-inference forward did not).
        recs = [r for r in executor.records.get(i, []) if r.bwd_start > 0]
        for mb, r in enumerate(recs):
            saved.extend(replace(t, microbatch=mb) for t in r.saved)
        n = max(1, len(recs))
        blocks.append(BlockProfile(
            index=i, saved_bytes=int(sum(r.saved_bytes for r in recs) / n), tensors=int(round(sum(r.tensors for r in recs) / n)),
            input_bytes=int(sum(r.input_bytes for r in recs) / n), fwd_s=sum(r.fwd_s for r in recs) / n,
            bwd_s=sum(r.bwd_s for r in recs) / n, gap_s=min((r.gap_s for r in recs), default=0.0)))
    inflight = max(1, executor.max_inflight)
    if inflight_cap is not None:
        inflight = min(inflight, inflight_cap)
    estimate = peak
    if mode != "keep":
        kept = inflight * sum(b.saved_bytes for b in blocks)
        transient = (1 + executor.lookahead) * max((b.saved_bytes for b in blocks), default=0)
        estimate = peak + max(0, kept - transient)
    saved.sort(key=lambda t: (t.microbatch, t.block, t.index))
    return StageProfile(stage=stage.stage, device=device, blocks=tuple(blocks), peak_bytes=estimate,
                        inflight=inflight, microbatches=microbatches, mode=mode, measured_peak_bytes=peak,
                        saved=tuple(saved), budget_bytes=budget, clock_s=executor.origin)
