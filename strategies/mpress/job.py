"""An MPress pipeline job: what one training run on the pipeline is, and its unpipelined reference.

:class:`PipelineJob` holds everything every stage process needs to build the same model,
split it, profile, plan and train; :func:`job_batch` is the batch every stage draws from the
job's seed, and :func:`reference` runs the same job unpipelined in this process, for
comparison.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PipelineJob", "SCHEDULES", "PROFILE_MODES", "PLANNED", "job_batch", "reference"]

#: Schedule names accepted by :class:`PipelineJob`.
SCHEDULES = ("gpipe", "1f1b")
#: How the profiled iteration treats saved activations: ``auto`` keeps them when the stage's
#: estimated all-keep peak fits its device and host-swaps them otherwise; ``keep`` and ``host``
#: force one way.
PROFILE_MODES = ("auto", "keep", "host")
#: Plan names that profile one step and run the planner (``recompute``: recomputation only).
PLANNED = ("auto", "recompute")


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
        budgets: stage -> bytes (or ``"12MB"``) its device may use: the planner's budgets and,
            in the measured steps, the memory caps (stages absent: the device's full memory).
            Stages that share a device share its budget: give them the same one.
        profile: run the profiled iteration even when ``plan`` does not need it.
        min_bytes: saved tensors smaller than this are always kept.
        overlap: override for the planner's copy/compute overlap (None: ``caps.async_copy``).
        dtype: parameter dtype of the model (None: fp32, the default of :func:`strategies.models.build_model`).
        profile_mode: one of :data:`PROFILE_MODES`: how the profiled iteration treats activations.
        devices: stage -> device index (None: stage ``s`` on device ``s``). Stages may share a
            device (``(0, 0)``: two stage processes on one accelerator); budgets, plans and
            ``peer:<j>`` decisions still name stages, so ``peer:1`` is stage 1's pool wherever
            stage 1 runs. Stages that share a device exchange activations over the host
            (:func:`xpu.dist.p2p_library`), their peer pools still go through the backend's IPC;
            the planner fits their peaks together into the device's budget (and never swaps
            between them: the same memory).
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
    devices: tuple[int, ...] | None = None

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
        if self.devices is not None:
            devices = self.devices
            if not isinstance(devices, (list, tuple)) or len(devices) != stages:
                raise ValueError(f"devices must list one device index per stage ({stages}), got {devices!r}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
                raise ValueError(f"devices must be non-negative device indices, one per stage, got {devices!r}")
        if self.devices is not None and self.budgets:
            given: dict[int, tuple[int, Any]] = {}
            for s in range(stages):
                d, b = self.device_of(s), self.budgets.get(s)
                if d in given and _bytes_or_none(given[d][1]) != _bytes_or_none(b):
                    raise ValueError(f"stages {given[d][0]} and {s} share device {d} but have budgets {given[d][1]!r} "
                                     f"and {b!r}; give stages on one device the same budget (the device's)")
                given.setdefault(d, (s, b))

    def device_of(self, stage: int) -> int:
        """The device index stage ``stage`` runs on (the ``devices`` map, else ``stage`` itself)."""
        return int(self.devices[stage]) if self.devices is not None else stage

    def shares_devices(self, stages: int) -> bool:
        """Whether two of the ``stages`` stages run on one device."""
        return len({self.device_of(s) for s in range(stages)}) < stages

    def stages_on(self, device: int, stages: int) -> list[int]:
        """The stages (of ``stages``) that run on ``device``."""
        return [s for s in range(stages) if self.device_of(s) == device]

    def check_devices(self, stages: int, device_count: int, backend_name: str, key: str = "devices") -> None:
        """Check that every stage's device exists on a backend with ``device_count`` devices (ValueError);
        ``key`` is what the message calls the map."""
        for s in range(stages):
            d = self.device_of(s)
            if d >= device_count:
                where = f"{key}[{s}] = {d}" if self.devices is not None else f"stage {s} (on device {s} by default)"
                raise ValueError(f"{where} is out of range: backend '{backend_name}' has {device_count} device(s) "
                                 f"(0..{device_count - 1}); give {key} with indices in that range")


def _bytes_or_none(value: Any) -> int | None:
    """A budget as bytes (``"12MB"`` and 12000000 alike); None stays None."""
    from xpu.units import parse_bytes

    return None if value is None else parse_bytes(value)


def job_batch(job: PipelineJob) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's ``(inputs, targets)`` batch, drawn from its seed (the same in every stage process)."""
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
    idx, tgt = job_batch(job)
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
