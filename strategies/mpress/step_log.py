"""Rank 0's step rows of ``xpu mpress`` into ``xpu train``'s ``logging:`` writers (CSV, TensorBoard, W&B).

The writers are :mod:`strategies.training.log_sinks`' callbacks, fed the same :class:`RunInfo`,
:class:`StepReport` and :class:`TrainResult` as ``xpu train`` gives them; a row's device peak is
the largest stage's. Other ranks, and runs without ``logging:``, get a log that does nothing.
"""
from __future__ import annotations

from typing import Any

from strategies.training import TrainConfig
from strategies.training.reports import CallbackList, RunInfo, StepReport, TrainResult

__all__ = ["PipelineLog"]


class PipelineLog:
    """The ``logging:`` writers of one rank (none off rank 0), opened by :meth:`start`, closed by :meth:`end`."""

    def __init__(self, train: TrainConfig) -> None:
        from strategies.training.log_sinks import make_sinks

        sinks = make_sinks(train)  # none when logging is unset or this is not rank 0
        self.sinks = CallbackList(sinks) if sinks else None
        self.info: RunInfo | None = None
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def start(self, **info: Any) -> None:
        """Open the writers with the run's :class:`RunInfo` fields."""
        self.info = RunInfo(**info)
        if self.sinks is not None:
            self.sinks.on_start(self.info)

    def step(self, report: StepReport) -> None:
        """One finished step's row."""
        self.steps.append(report.step)
        self.lrs.append(report.lr)
        if self.sinks is not None:
            self.sinks.on_step(report)

    def end(self, summary: dict[str, Any] | None) -> None:
        """Close the writers: after the run with its summary, or after a failure with None."""
        if self.sinks is None:
            return
        result = None
        if summary is not None and self.info is not None:
            times = summary["step_times_s"]
            result = TrainResult(self.steps, summary["losses"], self.lrs, times, max(summary["peaks"]),
                                 max(summary["peaks"]), summary["wall_s"],
                                 self.info.tokens_per_step * len(times) / max(sum(times), 1e-12),
                                 summary["checkpoints"], self.info)
        self.sinks.on_end(result)
