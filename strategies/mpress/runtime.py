"""Running an MPress plan: one rank's stage with the plan's peer pools open and its executor set.

:class:`StageRuntime` takes a built stage (:mod:`strategies.mpress.build`), its
profiles (:mod:`strategies.mpress.profiling`) and the plan every rank agreed on
(:func:`~strategies.mpress.stage_setup.plan_stage`), and opens the peer pools: each device that
hosts regions exports them (counted against its own budget) and the writers import them
one-sidedly (:mod:`strategies.mpress.ipc`). Then :meth:`StageRuntime.step` trains, and
:meth:`StageRuntime.close` releases the pools. :mod:`strategies.mpress.stage_setup` strings the
steps together.
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from .build import BuiltStage
from .planner import Plan, format_plan
from .profiling import Profiled

__all__ = ["StageRuntime"]


class StageRuntime:
    """One rank's pipeline stage following a plan, ready to train.

    Built from a plan by the steps of :mod:`strategies.mpress.stage_setup` (``setup_stage`` runs
    them all). Construction is collective, so every rank of the group must construct its runtime
    together. Afterwards
    :meth:`step` runs one pipelined forward/backward (gradients accumulate in the stage's
    parameters; the caller zeroes them and steps its optimizer) and :meth:`close` releases the
    pools (also collective). The benchmark system keeps one alive across steps.

    Attributes:
        built: the :class:`~strategies.mpress.build.BuiltStage` it runs.
        profiled: what profiling found (:class:`~strategies.mpress.profiling.Profiled`).
        job: the job it was built for.
        rank, world: this stage's index and the pipeline depth.
        device: the device index the stage runs on (``job.device_of(rank)``).
        stage: this rank's :class:`~strategies.mpress.stages.StageModule`, on device :attr:`device`.
        budgets: stage -> byte budget of its device (the job's, parsed).
        profile: this stage's profile, when one was taken.
        profiles: every stage's profile, by stage (all None when none was taken); the planner's input.
        plan: the plan every rank agreed on.
        decisions: this stage's per-block decisions.
        owned: the peer-pool buffers this device hosts; regions: peer -> the region this stage writes there.
        result: what :func:`~strategies.mpress.pipeline.run_jobs` reports so far (``plan_text``,
            ``profile``, ``profile_choice``, ``calibration``).
    """

    def __init__(self, built: BuiltStage, plan: Plan, profiled: Profiled) -> None:
        """The runtime of ``built`` following ``plan`` (collective: every rank opens the peer pools together)."""
        self._adopt(built, profiled)
        self.follow(plan)

    def _adopt(self, built: BuiltStage, profiled: Profiled) -> None:
        """Take over ``built`` and its profiles, following no plan yet."""
        self.built, self.profiled = built, profiled
        self.job, self.rank, self.world, self.backend = built.job, built.rank, built.world, built.backend
        self.device = built.device
        self.stage, self.budgets = built.stage, built.budgets
        self.profile, self.profiles = profiled.own, profiled.stages
        self.result: dict[str, Any] = {"rank": built.rank}
        if profiled.choice is not None:
            self.result["profile_choice"] = profiled.choice
        if profiled.own is not None:
            self.result["profile"] = profiled.own
        self.plan: Plan | None = None
        self.decisions: dict[int, Any] = {}
        self.owned: list[Any] = []
        self.regions: dict[int, Any] = {}

    def follow(self, plan: Plan) -> None:
        """Carry out ``plan`` from now on: open its peer pools and give the stage its executor (collective).

        A runtime switches plans by :meth:`close` and then this.
        """
        self.plan = plan
        self.result["plan_text"] = format_plan(plan, self.profiles)
        self.owned, _handles, self.regions = _open_pools(plan, self.rank, self.world, self.backend, self.device)
        self.decisions = plan.decisions(self.rank) if self.rank < len(plan.stages) else {}
        self.stage.executor = self.built.executor(self.decisions, self.regions)

    def measure_peaks(self) -> list[int]:
        """Every device's peak in one uncapped step of the job's batch (collective); also kept in
        ``result["calibration"]``."""
        import torch.distributed as dist

        gc.collect()
        self.backend.reset_peak_memory(self.device)
        self.built.trial_step()
        self.stage.zero_grad(set_to_none=True)
        peaks: list[Any] = [None] * self.world
        dist.all_gather_object(peaks, self.backend.memory_stats(self.device).peak_allocated)
        self.result.setdefault("calibration", []).append(peaks)
        return peaks

    def cap(self) -> int | None:
        """This stage's memory cap: its device's budget (None: the job gives none).

        Stages that share a device split its budget in proportion to the peaks they measured
        last (``result["calibration"]``; evenly before any measurement): each process caps
        its own allocations, and the caps add up to the budget.
        """
        budget = self.built.device_budgets().get(self.device)
        mates = self.job.stages_on(self.device, self.world)
        if budget is None or len(mates) == 1:
            return budget
        peaks = (self.result.get("calibration") or [None])[-1]
        total = sum(peaks[s] for s in mates) if peaks is not None else 0
        return budget * peaks[self.rank] // total if total else budget // len(mates)

    def apply_cap(self) -> None:
        """Cap this stage's device at :meth:`cap` (if the job gives a budget) and reset the peak counter."""
        cap = self.cap()
        if cap is not None:
            self.backend.set_memory_cap(self.device, cap)
        gc.collect()
        self.backend.reset_peak_memory(self.device)

    def step(self, idx: torch.Tensor | None, tgt: torch.Tensor | None) -> list[torch.Tensor]:
        """One pipelined forward and backward of the whole batch (:meth:`BuiltStage.step
        <strategies.mpress.build.BuiltStage.step>`); the last stage's per-micro-batch losses."""
        return self.built.step(idx, tgt)

    def close(self) -> None:
        """Wait until no stage writes into the peer pools any more, then free them (collective)."""
        import torch.distributed as dist

        dist.barrier()
        self.owned, self.regions = [], {}
        self.stage.executor = None
        gc.collect()


def _open_pools(plan: Any, rank: int, world: int, backend: Any, device: int) -> tuple[list[Any], dict, dict[int, Any]]:
    """Allocate the regions stage ``rank`` hosts (on ``device``) and open the ones it writes; returns
    (owned, handles, regions).

    Regions are named by stage; a pool always travels through the backend's IPC handles, even
    to a stage on the same device (another process: it cannot use the owner's pointer).
    """
    import torch.distributed as dist

    from .ipc import export_buffer, import_buffer, unlink_buffer

    owned, handles = [], {}
    for (writer, owner), nbytes in sorted(plan.regions.items()):
        if owner == rank:
            buf, handle = export_buffer(backend, int(nbytes), device)  # counted against this device
            owned.append(buf)
            handles[(writer, owner)] = handle
    all_handles: list[Any] = [None] * world
    dist.all_gather_object(all_handles, handles)
    regions = {}
    for h in all_handles:
        for (writer, owner), handle in h.items():
            if writer == rank:
                regions[owner] = import_buffer(backend, handle)
    dist.barrier()  # every writer has mapped its region: the names can go
    for handle in handles.values():
        unlink_buffer(backend, handle)
    return owned, handles, regions
