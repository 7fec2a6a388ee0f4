"""What a run tells its caller: :class:`RunInfo` before, a :class:`StepReport` per step, a :class:`TrainResult` after
(:class:`CallbackList` hands each to several callbacks)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CallbackList", "RunInfo", "StepReport", "TrainCallback", "TrainResult"]


@dataclass
class RunInfo:
    """What a run is about to do (given to :meth:`TrainCallback.on_start`)."""

    name: str
    backend: str
    device: int
    dtype: str
    params: int
    strategy: str
    options: dict[str, Any]
    device_budget: int | None
    data: str
    start_step: int
    steps: int
    tokens_per_step: int
    resumed_from: str | None
    plan: str | None = None  # the strategy's explained plan, when it chose one (MemFerry's scheduler)
    run_id: str | None = None  # the run's identity, kept across resumes (a W&B run continues under it)
    world: int = 1  # data-parallel ranks (torchrun); ``tokens_per_step`` counts them all, config ``batch`` is per rank
    padded: bool = False  # batches as wide as their longest row (whole records): ``tokens_per_step`` is the most


@dataclass
class StepReport:
    """One finished step (given to :meth:`TrainCallback.on_step`).

    Attributes:
        step: 1-based step number; ``steps`` the total.
        loss: the step's loss; ``lr`` the rate it was updated with.
        step_s: wall seconds of the step, the loss read back included.
        peak_device_bytes: the device memory high-water mark of the run so far.
        log: True on every ``log_every``-th step and the last one.
        checkpoint: the file written after this step, if one was.
        eval_loss: the mean held-out loss after this step, on the steps ``eval_every`` names (else None).
        tokens: the input tokens the step's batches held over every rank, padding included (None:
            the run's ``tokens_per_step``; fewer where whole records are padded to their longest).
    """

    step: int
    steps: int
    loss: float
    lr: float
    step_s: float
    peak_device_bytes: int
    log: bool
    checkpoint: str | None = None
    eval_loss: float | None = None
    tokens: int | None = None


class TrainCallback:
    """Hooks :func:`train` calls; the defaults do nothing (the CLI's progress bar overrides them)."""

    def on_start(self, info: RunInfo) -> None:
        """Before the first step."""

    def on_step(self, report: StepReport) -> None:
        """After every step."""

    def on_notice(self, message: str) -> None:
        """A one-line notice the run goes on after (e.g. a resume that changed the learning rate); logged by default."""
        import logging

        logging.getLogger("strategies.training").warning(message)

    def on_end(self, result: "TrainResult | None") -> None:
        """After the run, also one that failed (``result`` None) or that failed before :meth:`on_start`: close files here."""


class CallbackList(TrainCallback):
    """Hands every hook to each of ``callbacks`` in order (the CLI's display and the ``logging`` sinks, say).

    ``on_end`` reaches every callback even when one of them raises; the first error is raised after.
    """

    def __init__(self, callbacks: "list[TrainCallback]") -> None:
        self.callbacks = list(callbacks)

    def on_start(self, info: RunInfo) -> None:
        """Each callback's ``on_start``."""
        for cb in self.callbacks:
            cb.on_start(info)

    def on_step(self, report: StepReport) -> None:
        """Each callback's ``on_step``."""
        for cb in self.callbacks:
            cb.on_step(report)

    def on_notice(self, message: str) -> None:
        """Each callback's ``on_notice``."""
        for cb in self.callbacks:
            cb.on_notice(message)

    def on_end(self, result: "TrainResult | None") -> None:
        """Each callback's ``on_end``, all of them even if one raises (a file still gets closed)."""
        error: BaseException | None = None
        for cb in self.callbacks:
            try:
                cb.on_end(result)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others closed
                error = error or exc
        if error is not None:
            raise error


@dataclass
class TrainResult:
    """What a run did.

    Attributes:
        steps: 1-based step numbers run here (a resumed run starts after the checkpoint's step).
        losses, lrs, step_times_s: per step run here.
        peak_device_bytes: device memory high-water mark (reserved) from engine set-up on.
        peak_allocated_bytes: the same for live tensors.
        wall_s: seconds from the first step to the end of the last, checkpoints included.
        tokens_per_s: input tokens (padding included) per second of step time.
        checkpoints: files written.
        info: the run's :class:`RunInfo`.
        eval_losses: ``(step, mean held-out loss)`` for each evaluation (``eval_every``).
    """

    steps: list[int]
    losses: list[float]
    lrs: list[float]
    step_times_s: list[float]
    peak_device_bytes: int
    peak_allocated_bytes: int
    wall_s: float
    tokens_per_s: float
    checkpoints: list[str]
    info: RunInfo
    eval_losses: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly."""
        return asdict(self)
