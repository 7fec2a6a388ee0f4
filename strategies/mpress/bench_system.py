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
        under the scenario's device cap, applied to every stage's device) or ``"keep"`` (no offload).
"""
from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any

import torch

from bench.systems.base import BenchSystem, SystemContext, phase

from .pipeline import SCHEDULES, PipelineJob, adamw_with_states, free_port

__all__ = ["MPressSystem", "make", "PLANS"]

#: Values of the ``plan`` option.
PLANS = ("auto", "keep")
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
    if ctx.backend.device_type != "cpu" and ctx.backend.device_count() < stages:
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
        import torch.multiprocessing as mp

        self.job, self.stages = build_job(ctx)
        self._procs: list[Any] = []
        self._peaks: list[int | None] = [None] * self.stages
        self._plan_text = ""
        self._failed = False
        env: dict[str, str] = {}
        if ctx.backend.device_type == "cpu" and "XPU_CPU_TOPOLOGY" not in os.environ:
            # The cpu backend's virtual devices: one per stage at least.
            env["XPU_CPU_DEVICES"] = str(max(self.stages, int(os.environ.get("XPU_CPU_DEVICES", "1") or 1)))
        mpctx = mp.get_context("spawn")
        self._commands = [mpctx.Queue() for _ in range(self.stages)]
        self._replies = mpctx.Queue()
        port = free_port()
        try:
            for rank in range(self.stages):
                proc = mpctx.Process(target=_stage_main, name=f"mpress-stage{rank}", daemon=True,
                                     args=(rank, self.stages, port, self.job, ctx.adamw_kwargs(),
                                           self._commands[rank], self._replies, ctx.backend.dist_backend, env,
                                           os.getpid()))
                proc.start()
                self._procs.append(proc)
            ready = self._collect("ready", _SETUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._plan_text = ready[0].get("plan_text", "")
        if self._plan_text and self.job.plan == "auto":
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
            for rank, q in enumerate(self._commands):
                q.put(("step", host_in if rank == 0 else None, host_tgt if rank == last else None))
            replies = self._collect("step", None)
        for rank, info in replies.items():
            self._peaks[rank] = info["peak"]
        return torch.tensor(replies[last]["loss"], dtype=torch.float32)

    def _collect(self, kind: str, timeout_s: float | None) -> dict[int, dict[str, Any]]:
        """One ``kind`` reply from every stage; raises the first stage error, or on a dead stage / timeout."""
        got: dict[int, dict[str, Any]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < self.stages:
            try:
                msg_kind, rank, info = self._replies.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    self._failed = True
                    # A stage that died without a word (killed, e.g. by the host's OOM killer).
                    raise RuntimeError(f"mpress: stage process {dead[0].name} exited with code {dead[0].exitcode} "
                                       f"while waiting for '{kind}'")
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"mpress: stages did not answer '{kind}' within {timeout_s:.0f} s")
                continue
            if msg_kind == "error":
                self._failed = True  # its peers are stuck in send/recv with it: close() need not wait
                _raise_stage_error(self._root_cause(rank, info))
            if msg_kind != kind:
                raise RuntimeError(f"mpress: stage {rank} answered {msg_kind!r}, expected {kind!r}")
            got[rank] = info
        return got

    def _root_cause(self, rank: int, info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The error to report: a stage's own failure (e.g. OOM) rather than a peer's broken send/recv.

        When one stage fails, its peers fail soon after on the closed connection; collect
        the errors that arrive within a moment and prefer an out-of-memory one, then one with
        a message.
        """
        errors = {rank: info}
        deadline = time.monotonic() + 3.0
        while len(errors) < self.stages and time.monotonic() < deadline:
            try:
                msg_kind, r, i = self._replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg_kind == "error":
                errors[r] = i
        return min(errors.items(), key=lambda kv: (not kv[1].get("oom"), not kv[1]["message"].strip(), kv[0]))

    def close(self) -> None:
        """Stop the stage processes (politely, then by force) and release the queues."""
        for q, proc in zip(self._commands, self._procs):
            if proc.is_alive():
                try:
                    q.put(("stop", None, None))
                except Exception:
                    pass
        deadline = time.monotonic() + (1 if self._failed else 15)
        for proc in self._procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._procs = []
        for q in [*self._commands, self._replies]:
            q.close()
            q.cancel_join_thread()
        self._commands = []


def _raise_stage_error(failure: tuple[int, dict[str, Any]]) -> None:
    """Re-raise a stage's failure (``(rank, info)``) here, keeping OOM recognisable to the harness."""
    rank, info = failure
    message = info["message"].strip() or "(no message; see the traceback)"
    text = f"mpress stage {rank}: {info['type']}: {message}\n{info['traceback']}"
    if info.get("oom"):
        raise torch.OutOfMemoryError(text)
    raise RuntimeError(text)


def _stage_main(rank: int, world: int, port: int, job: PipelineJob, adamw: dict[str, Any], commands: Any,
                replies: Any, dist_backend: str, env: dict[str, str], parent_pid: int) -> None:
    """Body of one stage process: set up, then serve ``step`` commands until ``stop`` (or the parent is gone)."""
    os.environ.update(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    import xpu

    from .pipeline import StageRuntime
    from .planner import InfeasibleBudgetError

    runtime = None
    try:
        backend = xpu.get_backend()
        if backend.device_count() < world:
            raise ValueError(f"{world} stages need {world} devices; backend '{backend.name}' has "
                             f"{backend.device_count()}")
        # A bounded timeout: a stage that dies must not leave its peers waiting forever.
        dist.init_process_group(dist_backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=float(os.environ.get("MPRESS_PG_TIMEOUT_S", "300"))))
        box: list[torch.optim.Optimizer] = []

        def prepare(stage: torch.nn.Module) -> None:
            box.append(adamw_with_states(stage, adamw))

        runtime = StageRuntime(job, rank, world, backend, prepare=prepare)
        if runtime.infeasible is not None:
            raise runtime.infeasible
        optimizer = box[0]
        runtime.apply_cap()
        replies.put(("ready", rank, {"plan_text": runtime.result.get("plan_text", ""),
                                     "decisions": {b: str(d) for b, d in runtime.decisions.items()}}))
        while True:
            try:
                cmd, idx, tgt = commands.get(timeout=5.0)
            except queue.Empty:
                if os.getppid() != parent_pid:  # the worker was killed (e.g. its timeout): do not linger
                    return
                continue
            if cmd == "stop":
                break
            with backend.device_scope(rank):
                idx = backend.to_device(idx, rank) if idx is not None else None
                tgt = backend.to_device(tgt, rank) if tgt is not None else None
                runtime.stage.zero_grad(set_to_none=True)
                losses = runtime.step(idx, tgt)
                optimizer.step()
                loss = float(torch.stack([l.float() for l in losses]).mean()) if losses else None
                del idx, tgt, losses
                backend.synchronize(rank)
            replies.put(("step", rank, {"loss": loss, "peak": backend.memory_stats(rank).peak_allocated}))
        runtime.close()
    except BaseException as exc:
        oom = isinstance(exc, (torch.OutOfMemoryError, MemoryError, InfeasibleBudgetError)) or \
            "out of memory" in str(exc).lower()
        replies.put(("error", rank, {"type": type(exc).__name__, "message": str(exc)[:2000],
                                     "traceback": traceback.format_exc()[-4000:], "oom": oom}))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def make(ctx: SystemContext) -> MPressSystem:
    """Factory registered as ``mpress``."""
    return MPressSystem(ctx)
