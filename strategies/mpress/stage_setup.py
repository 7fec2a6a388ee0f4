"""Setting one rank's MPress stage up, one named step at a time (every step collective):

    built = build_stage(job, rank, world, backend, prepare)    # 1. build: the stage on its device
    profiled = profile_stages(built)                            # 2. profile: measure it, gather all stages
    runtime = plan_and_run(built, profiled)                     # 3-5 below
    # which is:
    budgets = planning_budgets(built)
    plan = plan_stage(built, profiled, budgets)                 # 3. plan on rank 0, shared with every rank
    runtime = StageRuntime(built, plan, profiled)               # 4. run: peer pools and executor per the plan
    calibrate(runtime, budgets)                                 # 5. measure the plan; re-plan while over

:func:`setup_stage` runs them all. A budget no plan fits raises
:class:`~strategies.mpress.planner.InfeasibleBudgetError` on every rank from step 3 (or from a
re-plan in step 5), and a plan the job gives that does not fit its budget raises
:class:`~strategies.mpress.planner.PlanOverBudgetError` (a subclass) from step 5; a caller that
wants the profiles anyway (to report why) takes them from step 2 before planning.

Budgets are per device: stages that share one (``PipelineJob.devices``) share its budget, and
their measured peaks add up against it (each process counts its own allocations).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from xpu.dist import decide_on_first_rank

from .build import BuiltStage, build_stage
from .job import PLANNED, PipelineJob
from .planner import (InfeasibleBudgetError, Plan, PlanOverBudgetError, infeasible, link_rates, plan_offload,
                      stages_text)
from .profiling import Profiled, profile_stages
from .runtime import StageRuntime

__all__ = ["setup_stage", "plan_and_run", "planning_budgets", "plan_stage", "calibrate", "CALIBRATION_ROUNDS"]

#: Most plans :func:`calibrate` tries (the first included) before it lets the measured peaks stand.
CALIBRATION_ROUNDS = 4
#: Size of each peer region of a forced plan whose stages were not profiled.
_FORCED_REGION_BYTES = 1 << 20


def setup_stage(job: PipelineJob, rank: int, world: int, backend: Any,
                prepare: Callable[[torch.nn.Module], None] | None = None) -> StageRuntime:
    """Build, profile, plan and start this rank's stage (collective; see the module docstring).

    ``prepare`` is :func:`~strategies.mpress.build.build_stage`'s.

    Raises:
        InfeasibleBudgetError: no plan fits the job's budgets (on every rank).
    """
    built = build_stage(job, rank, world, backend, prepare)
    return plan_and_run(built, profile_stages(built))


def plan_and_run(built: BuiltStage, profiled: Profiled) -> StageRuntime:
    """Plan -> run -> measure (steps 3-5): the runtime of the plan that :func:`calibrate` settled on.

    Raises:
        InfeasibleBudgetError: no plan fits (on every rank).
    """
    budgets = planning_budgets(built)
    runtime = StageRuntime(built, plan_stage(built, profiled, budgets), profiled)
    calibrate(runtime, budgets)
    return runtime


def planning_budgets(built: BuiltStage) -> dict[int, int]:
    """Device -> the budget the planner plans for: the job's, else the device's whole memory."""
    given = built.device_budgets()
    devices = sorted({built.job.device_of(s) for s in range(built.world)})
    return {d: given[d] if d in given else _device_total(built.backend, d) for d in devices}


def plan_stage(built: BuiltStage, profiled: Profiled, budgets: dict[int, int], *, remeasured: bool = False) -> Plan:
    """The plan every rank follows: made on rank 0 and broadcast (collective).

    ``plan="auto"`` / ``"recompute"`` run :func:`~strategies.mpress.planner.plan_offload` on
    every stage's profile under ``budgets``; a ``{stage: {block: decision}}`` job is taken as
    given (:meth:`Plan.forced`), and ``"keep"`` is the empty plan. ``remeasured``: ``budgets``
    were lowered by measured overshoots (:func:`calibrate`), so a refusal's minimum is stated
    against the job's own budgets.

    Raises:
        InfeasibleBudgetError: no plan fits (on every rank: rank 0 broadcasts the refusal).
    """
    job, backend = built.job, built.backend

    def decide() -> Any:
        try:
            if job.plan in PLANNED:
                host_rate, peer_rate = link_rates(backend)
                overlap = backend.caps.async_copy if job.overlap is None else job.overlap
                swaps = job.plan == "auto"
                # Peer pools need buffers other processes can open: without caps.ipc only host swap remains.
                return plan_offload(profiled.stages, budgets, host_rate=host_rate, peer_rate=peer_rate,
                                    allow_peer=swaps and backend.caps.ipc and backend.caps.peer_access,
                                    allow_host=swaps, overlap=overlap)
            if isinstance(job.plan, dict):
                return Plan.forced(job.plan, profiled.stages if profiled.own is not None else None,
                                   region_bytes=_FORCED_REGION_BYTES)
            return Plan.forced({})
        except InfeasibleBudgetError as exc:  # returned, so every stage raises this refusal itself
            if remeasured:  # the minimum was found with lowered budgets: state it against the real ones
                real = {**budgets, **built.device_budgets()}
                minimum = {d: need + real[d] - budgets[d] for d, need in exc.minimum.items()}
                stages_on = {d: built.job.stages_on(d, built.world) for d in minimum}
                exc = infeasible(minimum, real, stages_on, " (after measuring the plan's real peaks)")
            return exc

    return decide_on_first_rank(decide, what="plan the pipeline")


def calibrate(runtime: StageRuntime, budgets: dict[int, int], rounds: int = CALIBRATION_ROUNDS) -> None:
    """Check the runtime's plan by one uncapped step, and re-plan while a device overshoots (collective).

    The planner predicts peaks, the cap is enforced on measured ones: a device whose measured
    peak (the sum over its stages) exceeds its budget gets its planning budget (in ``budgets``,
    changed in place) lowered by what the plan's prediction missed (at least the overshoot),
    and the runtime switches to the plan made under it, ``rounds`` plans in all at most. A plan
    the job gives is measured once and refused if it does not fit. Only jobs with budgets are
    measured; each measurement's per-stage peaks are kept in ``runtime.result["calibration"]``
    (:meth:`StageRuntime.cap` splits a shared device's budget by the last one).

    Raises:
        InfeasibleBudgetError: a re-plan found no plan (on every rank).
        PlanOverBudgetError: the job's own plan does not fit a device's budget (on every rank).
    """
    built = runtime.built
    given = built.device_budgets()
    if not given:
        return
    if built.job.plan not in PLANNED:
        _refuse_if_over(built.device_loads(runtime.measure_peaks()), given, built)
        return
    for attempt in range(1, rounds + 1):
        loads = built.device_loads(runtime.measure_peaks())
        over = {d: loads[d] - b for d, b in given.items() if loads[d] > b}
        if not over or attempt == rounds:  # after the last round the capped steps report any overshoot as OOM
            return
        predicted = runtime.plan.device_peaks() if runtime.plan is not None else {}
        for d, extra in over.items():
            # Lowered by what the prediction missed, not only by the overshoot: a plan that
            # predicted less than its budget would otherwise come back unchanged.
            budgets[d] -= max(extra, loads[d] - predicted.get(d, loads[d]))
        runtime.close()  # nobody writes into the old plan's pools any more
        runtime.follow(plan_stage(built, runtime.profiled, budgets, remeasured=True))


def _refuse_if_over(loads: dict[int, int], given: dict[int, int], built: BuiltStage) -> None:
    """Raise :class:`PlanOverBudgetError` naming every device whose measured ``loads`` exceed ``given``
    (every rank measured the same peaks, so every rank raises the same error)."""
    from xpu.units import format_bytes

    over = {d: load for d, load in sorted(loads.items()) if d in given and load > given[d]}
    if not over:
        return
    parts = []
    for d, load in over.items():
        stages = built.job.stages_on(d, built.world)
        alone = len(stages) == 1
        parts.append(f"{stages_text(stages)} (device {d}) peak{'s' if alone else ''} at {format_bytes(load)}"
                     f"{'' if alone else ' together'}, over the device's budget of {format_bytes(given[d])}")
    raise PlanOverBudgetError("the given plan does not fit: " + "; ".join(parts) + " (measured in one uncapped step)",
                              over)


def _device_total(backend: Any, index: int) -> int:
    """Device ``index``'s whole memory from the topology (NVML on CUDA: no runtime call, so a
    stage process opens no context on its peers' devices); ``mem_info`` where the topology does
    not know it."""
    devices = backend.topology().devices
    spec = next((d for d in devices if d.index == index), None)
    if spec is not None and spec.total_bytes:
        return int(spec.total_bytes)
    return backend.mem_info(index)[1]
