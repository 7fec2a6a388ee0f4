"""The ``logging:`` key's writers: each step's row to a CSV file, TensorBoard and Weights & Biases.

    logging:
      csv: runs/x/log.csv            # one row per step, flushed as written; a resumed run appends
      tensorboard: runs/x/tb         # needs `pip install tensorboard`
      wandb: {project: xpu, name: x} # needs `pip install wandb`; also entity, mode: online|offline|disabled

Each writer is a :class:`~.reports.TrainCallback` (:func:`train` adds them beside its caller's
callback through :class:`~.reports.CallbackList`); they open their files in ``on_start`` and close
them in ``on_end``. Rows hold :data:`COLUMNS`. Under ``torch.distributed`` only rank 0 writes.
A missing package is a one-line :class:`TrainConfigError` when the config is checked, before the run.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import TrainConfigError
from .reports import RunInfo, StepReport, TrainCallback, TrainResult

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["COLUMNS", "CsvSink", "LogSink", "TensorBoardSink", "WandbSink", "check_logging", "make_sinks"]

#: A step row's fields, in the CSV's column order.
COLUMNS = ("step", "loss", "lr", "step_s", "tokens_per_s", "peak_device_bytes", "eval_loss")
_WANDB_KEYS = ("project", "name", "entity", "mode")
_WANDB_MODES = ("online", "offline", "disabled")


def _installed(name: str) -> bool:
    """Whether ``import name`` can work, without importing it (wandb's import alone takes seconds)."""
    if name in sys.modules:  # a test's stand-in, or None: blocked
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def _path_key(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise TrainConfigError(f"logging.{key} must be a path, got {value!r}")


def check_logging(config: "TrainConfig") -> None:
    """The ``logging`` section's values and the packages its writers need.

    Raises:
        TrainConfigError: a bad value, an unknown ``wandb`` key, or a writer whose package is not installed.
    """
    section = config.logging
    if section is None:
        return
    if section.csv is not None:
        _path_key("csv", section.csv)
        if Path(section.csv).expanduser().is_dir():
            raise TrainConfigError(f"logging.csv {section.csv!r} is a folder; give a file, e.g. {section.csv}/log.csv")
    if section.tensorboard is not None:
        _path_key("tensorboard", section.tensorboard)
        if not _installed("tensorboard"):
            raise TrainConfigError("logging.tensorboard needs the tensorboard package: pip install tensorboard "
                                   "(or drop logging.tensorboard)")
    if section.wandb is not None:
        w = section.wandb
        if not isinstance(w, dict):
            raise TrainConfigError(f"logging.wandb must be a mapping like {{project: P, name: N}}, got {w!r}")
        unknown = set(w) - set(_WANDB_KEYS)
        if unknown:
            raise TrainConfigError(f"unknown logging.wandb key(s) {sorted(unknown)}; valid: {', '.join(_WANDB_KEYS)}")
        if not isinstance(w.get("project"), str) or not w["project"]:
            raise TrainConfigError(f"logging.wandb needs 'project': the W&B project name, got {w.get('project')!r}")
        for key in ("name", "entity"):
            if w.get(key) is not None and not isinstance(w[key], str):
                raise TrainConfigError(f"logging.wandb.{key} must be a string, got {w[key]!r}")
        if w.get("mode") is not None and w["mode"] not in _WANDB_MODES:
            raise TrainConfigError(f"logging.wandb.mode {w['mode']!r} is not valid; valid: {', '.join(_WANDB_MODES)}")
        if not _installed("wandb"):
            raise TrainConfigError("logging.wandb needs the wandb package: pip install wandb (or drop logging.wandb)")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def make_sinks(config: "TrainConfig") -> list[TrainCallback]:
    """The writers ``config.logging`` names (none when it is unset, or on a rank other than 0)."""
    section = config.logging
    if section is None or not _is_rank0():
        return []
    sinks: list[TrainCallback] = []
    if section.csv is not None:
        sinks.append(CsvSink(section.csv))
    if section.tensorboard is not None:
        sinks.append(TensorBoardSink(section.tensorboard))
    if section.wandb is not None:
        sinks.append(WandbSink(dict(section.wandb), config))
    return sinks


class LogSink(TrainCallback):
    """A writer of step rows: :meth:`row` gives a step's :data:`COLUMNS`; notices are the display's, not a log's."""

    def __init__(self) -> None:
        self.info: RunInfo | None = None

    def on_start(self, info: RunInfo) -> None:
        """Remember the run (its tokens per step give each row's throughput)."""
        self.info = info

    def on_notice(self, message: str) -> None:
        """Nothing: the run's other callback shows notices."""

    def row(self, report: StepReport) -> dict[str, Any]:
        """The step's values by column name (``eval_loss`` None off evaluation steps)."""
        tokens = report.tokens if report.tokens is not None else self.info.tokens_per_step if self.info is not None else 0
        return {"step": report.step, "loss": report.loss, "lr": report.lr, "step_s": report.step_s,
                "tokens_per_s": tokens / report.step_s if report.step_s > 0 else 0.0,
                "peak_device_bytes": report.peak_device_bytes, "eval_loss": report.eval_loss}


class CsvSink(LogSink):
    """Rows to a CSV file with a header, flushed per row (a killed run keeps what it wrote).

    A fresh run starts the file over. A resumed run appends without a second header, after
    dropping rows past the step it resumed from (the killed run's steps it will run again).
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path).expanduser()
        self._file: Any = None
        self._writer: Any = None

    def on_start(self, info: RunInfo) -> None:
        """Open the file: a new one, or the resumed run's, cut back to ``info.start_step``."""
        super().on_start(info)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._rows_up_to(info.start_step) if info.start_step and self.path.is_file() else None
            if kept is not None:
                self._rewrite(kept)
                self._file = open(self.path, "a", newline="", encoding="utf-8")
            else:
                self._file = open(self.path, "w", newline="", encoding="utf-8")
        except OSError as exc:
            raise TrainConfigError(f"logging.csv {str(self.path)!r}: {exc.strerror or exc}") from None
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if kept is None:
            self._writer.writeheader()
            self._file.flush()

    def _rows_up_to(self, step: int) -> list[list[str]] | None:
        """The file's rows of steps <= ``step`` (None: an empty file); a file of other columns is refused."""
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if not rows:
            return None
        if tuple(rows[0]) != COLUMNS:
            raise TrainConfigError(f"logging.csv {str(self.path)!r} has columns {rows[0]}, not {list(COLUMNS)}; "
                                   f"give a new file for this run")
        return [r for r in rows[1:] if r and int(r[0]) <= step]

    def _rewrite(self, rows: list[list[str]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(COLUMNS)
            out.writerows(rows)
        os.replace(tmp, self.path)  # a crash here leaves the old file whole

    def on_step(self, report: StepReport) -> None:
        """One row, flushed (floats as ``repr``: they read back equal)."""
        row = self.row(report)
        self._writer.writerow({k: "" if v is None else v for k, v in row.items()})
        self._file.flush()

    def on_end(self, result: TrainResult | None) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink(LogSink):
    """Scalars ``train/<column>`` (and ``eval/loss``) through ``torch.utils.tensorboard.SummaryWriter``.

    A resumed run purges the folder's events past its start step, so re-run steps appear once.
    """

    def __init__(self, log_dir: str | Path) -> None:
        super().__init__()
        self.log_dir = str(Path(log_dir).expanduser())
        self.writer: Any = None

    def on_start(self, info: RunInfo) -> None:
        """Open a writer on the folder."""
        super().on_start(info)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=info.start_step + 1 if info.start_step else None)

    def on_step(self, report: StepReport) -> None:
        """The step's scalars, flushed."""
        row = self.row(report)
        step = row.pop("step")
        eval_loss = row.pop("eval_loss")
        for key, value in row.items():
            self.writer.add_scalar(f"train/{key}", value, step)
        if eval_loss is not None:
            self.writer.add_scalar("eval/loss", eval_loss, step)
        self.writer.flush()

    def on_end(self, result: TrainResult | None) -> None:
        """Close the writer."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbSink(LogSink):
    """Rows to a Weights & Biases run (``wandb.init`` with the config; the run id kept across resumes)."""

    def __init__(self, settings: dict[str, Any], config: "TrainConfig") -> None:
        super().__init__()
        self.settings = settings
        self.config = config.to_dict()
        self.name = settings.get("name") or config.name
        self.run: Any = None

    def on_start(self, info: RunInfo) -> None:
        """``wandb.init`` (resume "allow": a resumed run continues the same W&B run)."""
        super().on_start(info)
        import wandb

        self.run = wandb.init(project=self.settings["project"], name=self.name, entity=self.settings.get("entity"),
                              mode=self.settings.get("mode"), id=info.run_id, resume="allow", config=self.config)

    def on_step(self, report: StepReport) -> None:
        """``run.log`` of the row at its step (``eval/loss`` only on evaluation steps)."""
        row = self.row(report)
        step = row.pop("step")
        eval_loss = row.pop("eval_loss")
        values = {f"train/{k}": v for k, v in row.items()}
        if eval_loss is not None:
            values["eval/loss"] = eval_loss
        self.run.log(values, step=step)

    def on_end(self, result: TrainResult | None) -> None:
        """``run.finish`` (exit code 1 when the run failed)."""
        if self.run is not None:
            self.run.finish(exit_code=0 if result is not None else 1)
            self.run = None
