"""The MPress pipeline runtime: stage processes on one node over ``torch.distributed.pipelining``.

:func:`launch` spawns one process per stage (``torch.multiprocessing``, spawn start method);
each joins a process group of the backend's collective library (gloo on the cpu backend,
NCCL/HCCL on accelerators), builds the same model from the same seed, keeps its own stage
(:func:`~strategies.mpress.stages.split_model`) on device ``rank``, and runs the jobs it is
given one after the other (so tests pay for process start-up once). Under ``torchrun`` call
:func:`run_jobs` directly from each rank.

A job (:class:`PipelineJob`):

1. optionally profiles one iteration and gathers the stage profiles. The iteration keeps every
   block's activations when the stage fits its device that way; a stage that would not is
   profiled with every block host-swapped instead (the saved-tensor hooks still see each
   tensor's size), its all-keep peak estimated (``profile_mode``, :data:`PROFILE_MODES`).
   Each profile also records every saved tensor (size, producer, consumer, when it was saved
   and read: :class:`~strategies.mpress.executor.TensorRecord`) and the device's budget;
2. plans on rank 0 (``plan="auto"``: :func:`~strategies.mpress.planner.plan_offload`; or a
   forced ``{stage: {block: decision}}``) and broadcasts the plan or the infeasibility error;
3. allocates peer pools: each device that hosts regions exports them (counted against its
   own budget) and the writers import them one-sidedly (:mod:`strategies.mpress.ipc`);
4. applies the device budget as a memory cap and trains ``steps`` steps with the chosen
   schedule (GPipe or 1F1B), recording losses, the last step's gradients, measured peaks
   and executor statistics.

:class:`StageRuntime` is one rank's stage after steps 1-3, steppable any number of times;
the benchmark system (:mod:`strategies.mpress.bench_system`) keeps one per stage process alive
across training steps.

:func:`reference` runs the same model unpipelined for comparison.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["PipelineJob", "StageRuntime", "launch", "run_jobs", "reference", "SCHEDULES", "PROFILE_MODES", "PLANNED",
           "free_port", "adamw_with_states", "schedule_inflight"]

#: Schedule names accepted by :class:`PipelineJob`.
SCHEDULES = ("gpipe", "1f1b")
#: How the profiled iteration treats saved activations: ``auto`` keeps them when the stage's
#: estimated all-keep peak fits its device and host-swaps them otherwise; ``keep`` and ``host``
#: force one way.
PROFILE_MODES = ("auto", "keep", "host")
#: Plan names that profile one step and run the planner (``recompute``: recomputation only).
PLANNED = ("auto", "recompute")
#: Fraction of a device's memory ``profile_mode="auto"`` leaves unused when it decides whether
#: a stage fits all kept (allocator fragmentation, and the estimate's own error).
PROFILE_HEADROOM = 0.05


@dataclass(frozen=True)
class PipelineJob:
    """One pipeline training run.

    Attributes:
        dims: model dimensions for :func:`strategies.models.build_model` (``seq`` included).
        family: model family (``gpt`` or ``llama``).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        microbatches: micro-batches per step.
        batch: global batch (split into ``microbatches`` equal micro-batches).
        steps: training steps; SGD with ``lr`` between them (``lr=0``: gradients only).
        lr: SGD learning rate.
        seed: model and data seed (every process builds the same model).
        counts: blocks per stage (None: even split).
        plan: ``"keep"`` (no offload), ``"auto"`` (profile + planner), ``"recompute"`` (profile +
            planner allowed only recomputation: the recompute-only baseline) or
            ``{stage: {block: "host"|...}}``.
        budgets: device -> bytes (or ``"12MB"``) used as memory caps in the measured steps; also
            the planner's budgets (devices absent: their full memory).
        profile: run the profiled iteration even when ``plan`` does not need it.
        min_bytes: saved tensors smaller than this are always kept.
        overlap: override for the planner's copy/compute overlap (None: ``caps.async_copy``).
        dtype: parameter dtype of the model (None: fp32, the default of :func:`strategies.models.build_model`).
        profile_mode: one of :data:`PROFILE_MODES`: how the profiled iteration treats activations.
    """

    dims: dict[str, Any]
    family: str = "gpt"
    schedule: str = "1f1b"
    microbatches: int = 4
    batch: int = 8
    steps: int = 1
    lr: float = 0.0
    seed: int = 0
    counts: tuple[int, ...] | None = None
    plan: Any = "keep"
    budgets: dict[int, Any] | None = None
    profile: bool = False
    min_bytes: int = 1024
    overlap: bool | None = None
    dtype: torch.dtype | None = None
    profile_mode: str = "auto"

    def validate(self, stages: int) -> None:
        """Check the job against a pipeline of ``stages`` stages; raises ValueError with the reason."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.microbatches < 1 or self.batch % self.microbatches:
            raise ValueError(f"batch {self.batch} must split into {self.microbatches} equal micro-batches")
        if self.schedule == "1f1b" and self.microbatches < stages:
            raise ValueError(f"1F1B needs at least as many micro-batches ({self.microbatches}) as stages ({stages})")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.profile_mode not in PROFILE_MODES:
            raise ValueError(f"unknown profile_mode {self.profile_mode!r}; valid: {', '.join(PROFILE_MODES)}")
        if not (self.plan in PLANNED + ("keep",) or isinstance(self.plan, dict)):
            raise ValueError(f"plan must be 'keep', 'auto', 'recompute' or {{stage: {{block: decision}}}}, got {self.plan!r}")
        from strategies.models import validate_dims

        validate_dims(self.family, dict(self.dims))
        if self.dims["layers"] < stages:
            raise ValueError(f"{self.dims['layers']} blocks cannot fill {stages} stages")


def free_port() -> int:
    """A free TCP port on the loopback interface (for the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(job: PipelineJob) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(job.seed + 1)
    seq, vocab = job.dims.get("seq", 16), job.dims["vocab"]
    idx = torch.randint(vocab, (job.batch, seq), generator=g)
    tgt = torch.randint(vocab, (job.batch, seq), generator=g)
    return idx, tgt


def reference(job: PipelineJob) -> dict[str, Any]:
    """The same training run unpipelined, in this process: ``{"losses": [...], "grads": {name: tensor}}``."""
    from strategies.models import build_model

    torch.manual_seed(job.seed)
    model = build_model(job.family, dtype=job.dtype, **job.dims)
    idx, tgt = _data(job)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr) if job.lr else None
    losses = []
    for step in range(job.steps):
        model.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        if opt is not None and step < job.steps - 1:
            opt.step()
    return {"losses": losses, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


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
    with tempfile.TemporaryDirectory(prefix="mpress-") as out:
        ctx = mp.start_processes(_stage_process, args=(stages, free_port(), jobs, out, dict(env or {})),
                                 nprocs=stages, start_method="spawn", join=False)
        while not ctx.join(timeout_s):
            pass
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
    # This stage's device current for good: NCCL stages collective objects on the current device.
    backend.bind_process(rank)
    # A bounded timeout: a stage that dies (e.g. out of memory) must not leave its peers waiting forever.
    dist.init_process_group(backend.dist_backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MPRESS_PG_TIMEOUT_S", "60"))))
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
    if backend.device_count() < world:
        raise ValueError(f"{world} stages need {world} devices; backend '{backend.name}' has {backend.device_count()}")
    return [_run_job(job, dist.get_rank(), world, backend) for job in jobs]


def adamw_with_states(stage: torch.nn.Module, adamw: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over ``stage``'s parameters with its states already allocated (and still initial).

    The states exist before the stage is profiled, so the planner sees them in the peaks.
    They are made by AdamW itself: one step on zero gradients at learning rate 0 leaves the
    parameters and the moments unchanged (all zero), then the step counters are reset.
    """
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, **adamw)
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0
    return optimizer


def schedule_inflight(schedule: str, microbatches: int, rank: int, world: int) -> int:
    """Most micro-batches whose activations stage ``rank`` holds at once under ``schedule``.

    GPipe runs every forward before any backward; 1F1B lets stage ``r`` run ``world - r``
    forwards before its first backward.
    """
    if schedule == "gpipe":
        return microbatches
    return max(1, min(microbatches, world - rank))


def _profile_of(executor: Any, stage: Any, rank: int, peak: int, microbatches: int, mode: str = "keep",
                inflight_cap: int | None = None, budget: int | None = None) -> Any:
    """The stage's :class:`StageProfile` from ``executor``'s records; ``peak`` is the measured one.

    With ``mode="host"`` every block was host-swapped, and ``peak_bytes`` estimates the
    all-keep peak in the planner's own terms: the measured peak, plus the saved bytes of the
    micro-batches in flight (what keeping them would hold), less the transient headroom the
    planner adds back for swapped blocks. So the planner predicts exactly the measured peak
    for the plan that swaps every block, the one this iteration ran.

    The tensor records of the micro-batches that ran backward are numbered 0, 1, ... in
    forward order (the micro-batch order of both schedules).
    """
    from dataclasses import replace

    from .planner import BlockProfile, StageProfile

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
    return StageProfile(stage=stage.stage, device=rank, blocks=tuple(blocks), peak_bytes=estimate,
                        inflight=inflight, microbatches=microbatches, mode=mode, measured_peak_bytes=peak,
                        saved=tuple(saved), budget_bytes=budget, clock_s=executor.origin)


def _on_device(backend: Any, rank: int, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on ``rank``'s device (copied there if it is elsewhere, e.g. a host batch); None stays None."""
    if t is None or t.device == backend.device(rank):
        return t
    return backend.to_device(t, rank)


def _device_total(backend: Any, index: int) -> int:
    """Device ``index``'s whole memory from the topology (NVML on CUDA: no runtime call, so a
    stage process opens no context on its peers' devices); ``mem_info`` where the topology does
    not know it."""
    devices = backend.topology().devices
    spec = next((d for d in devices if d.index == index), None)
    if spec is not None and spec.total_bytes:
        return int(spec.total_bytes)
    return backend.mem_info(index)[1]


class StageRuntime:
    """One rank's pipeline stage, built, profiled, planned and ready to train.

    The constructor does steps 1-3 of a job (build the stage on device ``rank``, profile if
    the plan needs it, plan on rank 0 and open the peer pools); it is collective, so every
    rank of the group must construct its runtime together. Afterwards :meth:`step` runs one
    pipelined forward/backward (gradients accumulate in the stage's parameters; the caller
    zeroes them and steps its optimizer) and :meth:`close` releases the pools (also collective).
    :func:`run_jobs` drives one per job; the benchmark system keeps one alive across steps.

    Attributes:
        job: the job it was built for.
        rank, world: this stage's index and the pipeline depth.
        stage: this rank's :class:`~strategies.mpress.stages.StageModule`, on device ``rank``.
        budgets: device -> byte budget (the job's, parsed).
        profile: this stage's profile, when one was taken.
        profiles: every stage's profile, by stage (all None when none was taken); the planner's input.
        plan: the plan every rank agreed on (None when infeasible).
        infeasible: the planner's :class:`~strategies.mpress.planner.InfeasibleBudgetError`, or None.
        decisions: this stage's per-block decisions.
        result: what :func:`run_jobs` reports so far (``plan_text``, ``profile``, ``calibration``).
    """

    def __init__(self, job: PipelineJob, rank: int, world: int, backend: Any,
                 prepare: Callable[[torch.nn.Module], None] | None = None) -> None:
        """Build, profile and plan this rank's stage (collective).

        Args:
            job: the job.
            rank, world: this stage's index and the pipeline depth.
            backend: the process's :class:`xpu.Backend`.
            prepare: called with the stage once its parameters are on the device, under the
                device's scope and before any profiling (e.g. to allocate optimizer states so
                that the profiled peaks and hence the plan count them).
        """
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from strategies.models import build_model
        from xpu.units import parse_bytes

        from .executor import StageExecutor
        from .planner import InfeasibleBudgetError, Plan, format_plan, link_rates, plan_offload
        from .stages import lm_loss, split_model

        self.job, self.rank, self.world, self.backend = job, rank, world, backend
        torch.manual_seed(job.seed)
        # Host memory, not counted: only this stage moves to the device.
        model = build_model(job.family, dtype=job.dtype, **job.dims)
        stage = split_model(model, world, list(job.counts) if job.counts else None)[rank]
        del model
        with backend.device_scope(rank):
            for p in stage.parameters():
                p.data = backend.to_device(p.data, rank)
            if prepare is not None:
                prepare(stage)
        self.stage = stage
        idx, tgt = _data(job)
        params = list(stage.parameters())
        stage.executor = StageExecutor(backend, rank, params=params, min_bytes=job.min_bytes)
        pipe = PipelineStage(stage, rank, world, backend.device(rank))
        self._schedule = (ScheduleGPipe if job.schedule == "gpipe" else Schedule1F1B)(pipe, job.microbatches,
                                                                                     loss_fn=lm_loss)

        def one_step() -> None:
            self.step(idx, tgt)

        self.budgets = budgets = {int(d): parse_bytes(b) for d, b in (job.budgets or {}).items()}
        self.result: dict[str, Any] = {"rank": rank}
        self.plan: Any = None
        self.infeasible: Any = None
        self.decisions: dict[int, Any] = {}
        self.owned: list[Any] = []
        self.regions: dict[int, Any] = {}
        profile = None
        if job.plan in PLANNED or job.profile:
            profile = self._profile(one_step, params)
            self.result["profile"] = profile
        self.profile = profile
        profiles: list[Any] = [None] * world
        dist.all_gather_object(profiles, profile)
        self.profiles = profiles

        # Plan, then check the plan by one uncapped step: the model predicts peaks, the cap is
        # enforced on measured ones. A device that overshoots gets its planning budget lowered by
        # the overshoot and the plan is redone (a few rounds at most).
        plan_budgets = {d: budgets[d] if d in budgets else _device_total(backend, d) for d in range(world)}
        for attempt in range(4):
            box: list[Any] = [None]
            if rank == 0:
                try:
                    if job.plan in PLANNED:
                        host_rate, peer_rate = link_rates(backend)
                        overlap = backend.caps.async_copy if job.overlap is None else job.overlap
                        swaps = job.plan == "auto"
                        # Peer pools need buffers other processes can open: without caps.ipc only host swap remains.
                        box[0] = plan_offload(profiles, plan_budgets, host_rate=host_rate, peer_rate=peer_rate,
                                              allow_peer=swaps and backend.caps.ipc and backend.caps.peer_access,
                                              allow_host=swaps, overlap=overlap)
                    elif isinstance(job.plan, dict):
                        box[0] = Plan.forced(job.plan, profiles if profile is not None else None, region_bytes=1 << 20)
                    else:
                        box[0] = Plan.forced({})
                except InfeasibleBudgetError as exc:
                    if attempt:  # the minimum was found with lowered budgets: state it against the real ones
                        minimum = {d: need + budgets.get(d, need) - plan_budgets[d] for d, need in exc.minimum.items()}
                        exc = InfeasibleBudgetError(str(exc) + " (after measuring the plan's real peaks)", minimum)
                    box[0] = exc
            dist.broadcast_object_list(box, src=0)
            plan = box[0]
            if isinstance(plan, InfeasibleBudgetError):
                self.infeasible = plan
                return
            self.plan = plan
            self.result["plan_text"] = format_plan(plan, profiles)
            self.owned, _handles, self.regions = _open_pools(plan, rank, world, backend)
            self.decisions = plan.decisions(rank) if rank < len(plan.stages) else {}
            stage.executor = StageExecutor(backend, rank, self.decisions, params=params, peer_regions=self.regions,
                                           min_bytes=job.min_bytes)
            if job.plan not in PLANNED or not budgets:
                break
            gc.collect()
            backend.reset_peak_memory(rank)
            one_step()
            stage.zero_grad(set_to_none=True)
            peaks: list[Any] = [None] * world
            dist.all_gather_object(peaks, backend.memory_stats(rank).peak_allocated)
            over = {d: peaks[d] - budgets[d] for d in budgets if d < world and peaks[d] > budgets[d]}
            self.result.setdefault("calibration", []).append(peaks)
            if not over or attempt == 3:  # after the last round the capped steps report any overshoot as OOM
                break
            for d, extra in over.items():
                plan_budgets[d] -= extra
            dist.barrier()  # nobody writes into the pools any more
            self.owned, self.regions = [], {}
            stage.executor = None
            gc.collect()

    def _profile(self, one_step: Callable[[], None], params: list[torch.Tensor]) -> Any:
        """Profile one iteration of this stage (see :data:`PROFILE_MODES`); returns its :class:`StageProfile`.

        The first step also infers the schedule's shapes (an extra forward), so it is a
        warm-up and the second step is the profiled one. Under ``profile_mode="auto"`` the
        warm-up runs with every block host-swapped, which fits wherever anything does, and
        measures what keeping them would need: the profiled step then keeps every block if
        that fits this device (exact peak) and host-swaps them otherwise (estimated peak).
        Without this, a stage whose activations do not fit its device all kept would run out
        of memory in profiling, before the planner could offload anything.

        Only the profiled step records each saved tensor (the warm-up sums per block); every
        stage starts it after a barrier, its tensor times counted from there.
        """
        import torch.distributed as dist

        from .executor import StageExecutor

        job, rank, backend, stage = self.job, self.rank, self.backend, self.stage
        swap_all = {b: "host" for b in stage.block_ids}
        inflight_cap = schedule_inflight(job.schedule, job.microbatches, rank, self.world)
        mode = job.profile_mode

        def executor(kind: str) -> StageExecutor:
            return StageExecutor(backend, rank, swap_all if kind == "host" else {}, params=params,
                                 min_bytes=job.min_bytes)

        stage.executor = executor("keep" if mode == "keep" else "host")
        stage.executor.profiling = mode == "auto"
        stage.executor.trace_tensors = False  # the warm-up needs per-block sums only
        gc.collect()
        backend.reset_peak_memory(rank)
        one_step()
        stage.zero_grad(set_to_none=True)
        if mode == "auto":
            # An upper bound of the all-keep peak: the swapped step's peak plus every in-flight
            # saved byte (counted per saved tensor, so shared ones more than once). The warm-up's
            # in-flight count includes shape inference's forward, which never runs backward: the
            # schedule's own count caps it.
            warm = _profile_of(stage.executor, stage, rank, 0, job.microbatches, "keep", inflight_cap)
            bound = backend.memory_stats(rank).peak_allocated + warm.inflight * sum(b.saved_bytes for b in warm.blocks)
            free, _total = backend.mem_info(rank)
            usable = free + backend.memory_stats(rank).reserved  # what this process can reach on the device
            mode = "keep" if bound <= usable * (1 - PROFILE_HEADROOM) else "host"
            self.result["profile_choice"] = {"keep_peak_bound": bound, "usable": usable, "mode": mode}
        stage.executor = executor(mode)
        stage.executor.profiling = True
        gc.collect()
        backend.reset_peak_memory(rank)
        # Every stage starts its clock together, so tensor times read alike across stages.
        dist.barrier()
        stage.executor.restart_clock()
        one_step()
        stage.executor.profiling = False
        budget = self.budgets.get(rank, backend.mem_info(rank)[1])  # as the planner takes it
        profile = _profile_of(stage.executor, stage, rank, backend.memory_stats(rank).peak_allocated,
                              job.microbatches, mode, budget=budget)
        stage.zero_grad(set_to_none=True)
        stage.executor = executor("keep")
        return profile

    def apply_cap(self) -> None:
        """Cap this stage's device at its budget (if the job gives it one) and reset the peak counter."""
        if self.rank in self.budgets:
            self.backend.set_memory_cap(self.rank, self.budgets[self.rank])
        gc.collect()
        self.backend.reset_peak_memory(self.rank)

    def step(self, idx: torch.Tensor | None, tgt: torch.Tensor | None) -> list[torch.Tensor]:
        """One pipelined forward and backward of the whole batch; the last stage's per-micro-batch losses.

        ``idx`` is read by the first stage, ``tgt`` by the last (others may pass None).
        Gradients accumulate into the stage's parameters (scaled so that they are the
        gradients of the mean over micro-batches).
        """
        stage, schedule = self.stage, self._schedule
        losses: list[torch.Tensor] = []
        # torch.distributed.pipelining feeds the first stage's inputs (and the last stage's
        # targets) to the module as given: a host batch must reach this stage's device first.
        idx, tgt = (_on_device(self.backend, self.rank, t) for t in (idx, tgt))
        with self.backend.device_scope(self.rank):
            if stage.is_first and stage.is_last:
                schedule.step(idx, target=tgt, losses=losses)
            elif stage.is_first:
                schedule.step(idx)
            elif stage.is_last:
                schedule.step(target=tgt, losses=losses)
            else:
                schedule.step()
        return [l.detach() for l in losses]

    def close(self) -> None:
        """Wait until no stage writes into the peer pools any more, then free them (collective)."""
        import torch.distributed as dist

        dist.barrier()
        self.owned, self.regions = [], {}
        self.stage.executor = None
        gc.collect()


def _run_job(job: PipelineJob, rank: int, world: int, backend: Any) -> dict[str, Any]:
    rt = StageRuntime(job, rank, world, backend)
    if rt.infeasible is not None:
        return {"rank": rank, "error": str(rt.infeasible), "minimum": rt.infeasible.minimum, "profile": rt.profile}
    stage, result = rt.stage, rt.result
    idx, tgt = _data(job)
    opt = torch.optim.SGD(stage.parameters(), lr=job.lr) if job.lr else None
    rt.apply_cap()
    losses: list[list[float]] = []
    try:
        for step in range(job.steps):
            stage.zero_grad(set_to_none=True)
            losses.append([float(l) for l in rt.step(idx, tgt)])
            if opt is not None and step < job.steps - 1:
                with backend.device_scope(rank):
                    opt.step()
    except Exception as exc:
        result["error"] = traceback.format_exc()
        # The other stages are blocked in send/recv with this one: fail the whole run with the
        # cause rather than let them time out on a collective.
        raise RuntimeError(f"stage {rank} failed in step {len(losses)}:\n{result['error']}\nplan:\n{result['plan_text']}") from exc
    finally:
        result["peak"] = backend.memory_stats(rank).peak_allocated
        result["cap"] = backend.memory_cap(rank)
        backend.set_memory_cap(rank, None)
    result["losses"] = losses
    result["grads"] = {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}
    result["stats"] = stage.executor.stats.as_dict()
    result["region_peak"] = {j: stage.executor.region_peak(j) for j in rt.regions}
    result["hosted_pool_bytes"] = sum(b.numel() for b in rt.owned)
    result["decisions"] = {b: str(d) for b, d in rt.decisions.items()}
    # Everyone must be done writing into the pools before owners free them.
    rt.close()
    return result


def _open_pools(plan: Any, rank: int, world: int, backend: Any) -> tuple[list[Any], dict, dict[int, Any]]:
    """Allocate the regions this device hosts and open the ones this stage writes; returns (owned, handles, regions)."""
    import torch.distributed as dist

    from .ipc import export_buffer, import_buffer, unlink_buffer

    owned, handles = [], {}
    for (writer, owner), nbytes in sorted(plan.regions.items()):
        if owner == rank:
            buf, handle = export_buffer(backend, int(nbytes), rank)  # counted against this device
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
