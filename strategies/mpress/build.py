"""Building one rank's pipeline stage: the first set-up step, before any profile or plan.

:func:`build_stage` builds the job's whole model on the host from its seed, keeps this rank's
stage (:func:`~strategies.mpress.stages.split_model`), moves its parameters to device ``rank``
and wraps it in a ``torch.distributed.pipelining`` schedule. The :class:`BuiltStage` it
returns can already step (every block kept); profiling and the plan decide later what its
executor does with the saved activations.

:func:`adamw_with_states` is the ``prepare`` hook that makes the optimizer states exist
before profiling, so that the plan counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .executor import StageExecutor
from .job import PipelineJob, job_batch
from .stages import StageModule

__all__ = ["BuiltStage", "build_stage", "adamw_with_states", "HostStaged"]


@dataclass
class BuiltStage:
    """One rank's stage on its device, driven by the job's pipeline schedule; no plan yet.

    Attributes:
        job: the job it was built for.
        rank, world: this stage's index and the pipeline depth.
        backend: the process's :class:`xpu.Backend`.
        stage: this rank's :class:`~strategies.mpress.stages.StageModule`, on device ``rank``.
        params: the stage's parameters (executors tell them apart from saved activations).
        schedule: the GPipe or 1F1B schedule that runs :attr:`stage` with its peers.
        budgets: stage -> byte budget of its device (the job's, parsed).
        device: the device index this stage runs on (``job.device_of(rank)``).
    """

    job: PipelineJob
    rank: int
    world: int
    backend: Any
    stage: StageModule
    params: list[torch.Tensor]
    schedule: Any
    budgets: dict[int, int]
    device: int = -1

    def __post_init__(self) -> None:
        if self.device < 0:  # built without a map: stage `rank` on device `rank`
            self.device = self.job.device_of(self.rank)

    def device_budgets(self) -> dict[int, int]:
        """Device -> the job's budget for it (stages on one device share theirs); devices without one absent."""
        return {self.job.device_of(s): b for s, b in self.budgets.items() if s < self.world}

    def device_loads(self, peaks: list[int]) -> dict[int, int]:
        """Device -> the sum of ``peaks`` (one per stage) of the stages on it: each process counts its own
        allocations, so stages sharing a device add up."""
        out: dict[int, int] = {}
        for s, peak in enumerate(peaks):
            out[self.job.device_of(s)] = out.get(self.job.device_of(s), 0) + peak
        return out

    def executor(self, decisions: dict[int, Any] | None = None,
                 peer_regions: dict[int, torch.Tensor] | None = None) -> StageExecutor:
        """A :class:`~strategies.mpress.executor.StageExecutor` for this stage carrying out ``decisions``."""
        return StageExecutor(self.backend, self.device, decisions, params=self.params, peer_regions=peer_regions,
                             min_bytes=self.job.min_bytes, stage=self.rank)

    def step(self, idx: torch.Tensor | None, tgt: torch.Tensor | None) -> list[torch.Tensor]:
        """One pipelined forward and backward of the whole batch; the last stage's per-micro-batch losses.

        ``idx`` is read by the first stage, ``tgt`` by the last (others may pass None).
        Gradients accumulate into the stage's parameters (scaled so that they are the
        gradients of the mean over micro-batches).
        """
        stage, schedule = self.stage, self.schedule
        losses: list[torch.Tensor] = []
        # torch.distributed.pipelining feeds the first stage's inputs (and the last stage's
        # targets) to the module as given: a host batch must reach this stage's device first.
        idx, tgt = (_on_device(self.backend, self.device, t) for t in (idx, tgt))
        with self.backend.device_scope(self.device):
            if stage.is_first and stage.is_last:
                schedule.step(idx, target=tgt, losses=losses)
            elif stage.is_first:
                schedule.step(idx)
            elif stage.is_last:
                schedule.step(target=tgt, losses=losses)
            else:
                schedule.step()
        return [l.detach() for l in losses]

    def trial_step(self) -> None:
        """One step on the job's own batch (:func:`~strategies.mpress.job.job_batch`): what profiling and
        calibration measure; the caller drops the gradients."""
        self.step(*job_batch(self.job))


def build_stage(job: PipelineJob, rank: int, world: int, backend: Any,
                prepare: Callable[[torch.nn.Module], None] | None = None) -> BuiltStage:
    """Build this rank's stage of ``job`` on its device (``job.device_of(rank)``); every rank builds the
    same model from the job's seed.

    When the job puts two stages on one device their process group is the host library
    (:func:`xpu.dist.p2p_library`), which sends host tensors only: the pipeline stage then
    exchanges activations and gradients in host memory (:class:`HostStaged`), and the stage
    itself still runs on its device.

    Args:
        job: the job.
        rank, world: this stage's index and the pipeline depth.
        backend: the process's :class:`xpu.Backend`.
        prepare: called with the stage once its parameters are on the device, under the
            device's scope and before any profiling (e.g. to allocate optimizer states so
            that the profiled peaks and hence the plan count them).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from strategies.models import build_model
    from xpu.units import parse_bytes

    from .stages import lm_loss, split_model

    torch.manual_seed(job.seed)
    # Host memory, not counted: only this stage moves to the device.
    model = build_model(job.family, dtype=job.dtype, **job.dims)
    stage = split_model(model, world, list(job.counts) if job.counts else None)[rank]
    del model
    device = job.device_of(rank)
    with backend.device_scope(device):
        for p in stage.parameters():
            p.data = backend.to_device(p.data, device)
        if prepare is not None:
            prepare(stage)
    params = list(stage.parameters())
    stage.executor = StageExecutor(backend, device, params=params, min_bytes=job.min_bytes, stage=rank)
    if job.shares_devices(world):
        pipe = PipelineStage(HostStaged(stage, backend.device(device)), rank, world, torch.device("cpu"))
    else:
        pipe = PipelineStage(stage, rank, world, backend.device(device))
    schedule = (ScheduleGPipe if job.schedule == "gpipe" else Schedule1F1B)(pipe, job.microbatches, loss_fn=lm_loss)
    budgets = {int(d): parse_bytes(b) for d, b in (job.budgets or {}).items()}
    return BuiltStage(job, rank, world, backend, stage, params, schedule, budgets, device)


class HostStaged(torch.nn.Module):
    """A stage whose inputs arrive and outputs leave in host memory, while it runs on ``device``.

    For pipeline stages whose process group sends host tensors only (stages sharing a device
    meet over gloo). The copies are autograd's own (``Tensor.to``), so gradients cross the same
    way back. The last stage's output stays on the device: the loss is computed there and
    nothing is sent. Meta tensors (a schedule's shape inference) pass through unmoved.
    """

    def __init__(self, stage: StageModule, device: torch.device) -> None:
        super().__init__()
        self.stage = stage  # registered: the schedule scales its parameters' gradients
        self.device = device

    def forward(self, *args: Any) -> Any:
        """The stage on its device; the output back in host memory unless this is the last stage."""
        out = self.stage(*(_moved(a, self.device) for a in args))
        return out if self.stage.is_last else _moved(out, torch.device("cpu"))


def _moved(t: Any, device: torch.device) -> Any:
    """``t`` on ``device`` by an autograd copy (anything but a real tensor elsewhere is returned as is)."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.device == device:
        return t
    return t.to(device)


def adamw_with_states(stage: torch.nn.Module, adamw: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over ``stage``'s parameters with its states already allocated (and still initial).

    The states exist before the stage is profiled, so the planner sees them in the peaks.
    They are made by AdamW itself: one step on zero gradients at learning rate 0 leaves the
    parameters and the moments unchanged (all zero), then the step counters are reset.
    """
    from strategies.weight_decay import param_groups

    params = [p for p in stage.parameters() if p.requires_grad]
    # Biases and norm weights get no decay, as in HF Trainer, MemFerry and the torch reference.
    settings = {k: v for k, v in adamw.items() if k != "weight_decay"}
    optimizer = torch.optim.AdamW(param_groups(stage, adamw.get("weight_decay", 0.01)), **settings)
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


def _on_device(backend: Any, device: int, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on device ``device`` (copied there if it is elsewhere, e.g. a host batch); None stays None."""
    if t is None or t.device == backend.device(device):
        return t
    return backend.to_device(t, device)
