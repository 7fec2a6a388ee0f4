"""``xpu train CONFIG.yaml``: train a model from a YAML config, with a progress bar.

    xpu train examples/train/gpt-tiny-memferry.yaml
    xpu train examples/train/gpt-tiny-memferry.yaml --steps 50 --set strategy.options.plan=dha
    xpu train examples/train/gpt-tiny-memferry.yaml --set checkpoint.dir=runs/t --set checkpoint.every=100
    xpu train examples/train/gpt-tiny-memferry.yaml --resume runs/t --steps 800

The config format is documented in :mod:`strategies.training`; a bad config is a one-line
error (exit status 2) before anything is built. Heavy imports happen in :func:`run`: the
``xpu`` CLI imports this module for every command (to list it).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from xpu.cli import register_command

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu train``."""
    parser.add_argument("config", help="training config YAML (see examples/train/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value by dotted key, e.g. model.layers=2 or strategy.options.plan=dha "
                             "(YAML value syntax); repeatable")
    parser.add_argument("--steps", type=int, help="total steps (a resumed run continues up to this)")
    parser.add_argument("--resume", metavar="PATH", help="continue from a checkpoint file, or the latest step-*.pt in a folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a checkpoint.dir that holds another run's step-*.pt files (deletes them)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar; log lines only")
    parser.add_argument("--json", action="store_true", help="print the result (losses, step times, memory) as one JSON object at the end")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from strategies.training.checks import parse_set_items
    from strategies.training import TrainConfigError

    out = parse_set_items(args.set, TrainConfigError)
    if args.steps is not None:
        out["steps"] = args.steps
    if args.resume is not None:
        out["resume"] = args.resume
    if getattr(args, "overwrite", False):
        out["checkpoint.overwrite"] = True
    return out


def _fmt_bytes(n: int) -> str:
    from xpu.units import format_bytes

    return format_bytes(n)


def run(args: argparse.Namespace) -> int:
    """Load and check the config, train with a progress bar, print a summary."""
    import os
    import sys

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from strategies.training import RunInfo, StepReport, TrainCallback, load_config, train
    from xpu.dist import leave_rank

    config = load_config(args.config, _overrides(args))
    # Log lines go to stderr with --json so stdout stays one parseable object.
    console = Console(stderr=args.json, highlight=False, soft_wrap=True)

    class _Display(TrainCallback):
        def __init__(self) -> None:
            self.progress: Progress | None = None
            self.task: Any = None
            self.last_step = 0

        def on_start(self, info: RunInfo) -> None:
            opts = ", ".join(f"{k}={v}" for k, v in info.options.items() if v is not None)
            budget = _fmt_bytes(info.device_budget) if info.device_budget else "whole device"
            console.print(f"xpu train {info.name}: {info.params / 1e6:.2f}M parameters, {info.strategy} ({opts}), "
                          f"{info.backend} device {info.device}, {info.dtype}, budget {budget}")
            console.print(f"data: {info.data}; {'up to ' if info.padded else ''}{info.tokens_per_step:,} tokens per step")
            if info.resumed_from:
                console.print(f"resumed from {info.resumed_from} at step {info.start_step}")
            if info.plan:
                console.print(f"plan chosen by the scheduler:\n{info.plan}")
            if config.logging is not None:  # where the rows go (rank 0 writes them)
                lg = config.logging
                where = [f"{k} {v}" for k, v in (("csv", lg.csv), ("tensorboard", lg.tensorboard)) if v]
                where += [f"wandb {lg.wandb['project']}/{lg.wandb.get('name') or info.name}"] if lg.wandb else []
                console.print(f"logging to {', '.join(where)}")
            if not args.no_progress:
                self.progress = Progress(
                    TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[step_ms]} ms/step"),
                    TextColumn("peak {task.fields[mem]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    console=console, transient=False)
                self.task = self.progress.add_task("train", total=info.steps, completed=info.start_step,
                                                   loss="-", step_ms="-", mem="-")
                self.progress.start()

        def on_notice(self, message: str) -> None:
            console.print(f"note: {message}")

        def on_step(self, r: StepReport) -> None:
            self.last_step = r.step
            if self.progress is not None:
                self.progress.update(self.task, completed=r.step, loss=f"{r.loss:.3f}", step_ms=f"{r.step_s * 1e3:.0f}",
                                     mem=_fmt_bytes(r.peak_device_bytes))
            if r.log or r.checkpoint or r.eval_loss is not None:
                line = (f"step {r.step:>6d}/{r.steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  {r.step_s * 1e3:7.1f} ms/step  "
                        f"peak {_fmt_bytes(r.peak_device_bytes)}")
                if r.eval_loss is not None:
                    line += f"  eval {r.eval_loss:.4f}"
                if r.checkpoint:
                    line += f"  saved {r.checkpoint}"
                (self.progress.console if self.progress is not None else console).print(line)

        def close(self) -> None:
            if self.progress is not None:
                self.progress.stop()

    display = _Display()
    try:
        result = train(config, display)
    except torch.OutOfMemoryError as exc:
        display.close()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        print(f"xpu train: error: out of device memory after step {display.last_step} "
              f"(device_budget {_fmt_bytes(config.device_budget) if config.device_budget else 'none'}): {first[:300]}; try a plan with +recompute or "
              f"fewer resident blocks, a smaller batch, or a larger device_budget", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        display.close()
        print(f"xpu train: interrupted after step {display.last_step}", file=sys.stderr)
        return 130
    finally:
        display.close()
    if result.info.world > 1 and os.environ.get("RANK", "0") != "0":
        leave_rank(0)  # data-parallel under torchrun: rank 0 alone reports (train() kept the others' callbacks silent)
    n = len(result.losses)
    head = result.losses[: max(1, min(10, n // 10 or 1))]
    tail = result.losses[-max(1, min(10, n // 10 or 1)):]
    console.print(f"done: {n} steps in {result.wall_s:.1f} s ({result.tokens_per_s:,.0f} tokens/s); "
                  f"loss {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f} (mean of first/last {len(head)}); "
                  f"peak device memory {_fmt_bytes(result.peak_device_bytes)}"
                  + (f"; eval loss {result.eval_losses[-1][1]:.3f}" if result.eval_losses else "")
                  + (f"; checkpoint {result.checkpoints[-1]}" if result.checkpoints else ""))
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    if result.info.world > 1:
        leave_rank(0)  # a torchrun rank, its group closed: past interpreter shutdown's thread teardown
    return 0


# `xpu <name>`: this module registers itself (the `xpu.commands` entry point in pyproject.toml names it).
register_command("train", "strategies.training.cli", "train a model from a YAML config", order=10)
