"""``xpu mpress CONFIG.yaml``: MPress pipeline training, one process per stage, through torchrun.

    xpu mpress examples/mpress/tiny.yaml
    xpu mpress examples/mpress/tiny.yaml --stages 4 --microbatches 8 --schedule gpipe --budget-gb 0.002
    xpu mpress examples/mpress/tiny.yaml --dry-run      # check the config, print the torchrun command
    xpu mpress examples/mpress/tiny.yaml --set 'strategy.options.devices=[0, 0]'   # both stages on device 0
    xpu mpress examples/mpress/tiny.yaml --profile-json prof.json   # dump every saved tensor of the profiled step

Run by hand, the command checks the config and the devices, then re-runs itself under
torchrun's module (``python -m torch.distributed.run --standalone --nproc_per_node N -m xpu
mpress ...``); under torchrun (``LOCAL_RANK`` and ``WORLD_SIZE`` set) it runs this rank's stage.
A bad config is a one-line error (exit status 2) before any process starts. The config format
and the training loop are documented in :mod:`strategies.mpress.launcher`. Heavy imports happen
in :func:`run`: the ``xpu`` CLI imports this module for every command (to list it).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from xpu.cli import register_command

__all__ = ["add_arguments", "run"]

#: Set by the launcher for its ranks: a file where rank 0 writes the exit status of an error
#: every rank shares (no plan fits, or the given plan does not). The ranks then exit 0, so
#: torchrun does not print its failure report over the one-line error, and the launcher exits
#: with the status.
_STATUS_ENV = "XPU_MPRESS_STATUS_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu mpress``."""
    parser.add_argument("config", help="training config YAML with strategy mpress (see examples/mpress/)")
    parser.add_argument("--stages", type=int, help="pipeline stages, one process each, on devices 0, 1, ... unless "
                                                    "strategy.options.devices maps them (strategy.options.stages)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step; must divide the batch "
                                                          "(strategy.options.microbatches)")
    parser.add_argument("--schedule", help="pipeline schedule: 1f1b or gpipe (strategy.options.schedule)")
    parser.add_argument("--budget-gb", type=float, metavar="X",
                        help="device memory each device may use, in GB (device_budget), shared by the stages on it; "
                             "the planner fits every device's stages to it")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="processes for torchrun to start: one per stage, so it sets --stages (default: the stages)")
    parser.add_argument("--steps", type=int, help="training steps")
    parser.add_argument("--resume", metavar="PATH",
                        help="continue from a checkpoint of xpu mpress (a step-N.pt, or a folder: its latest); "
                             "the stages, split, micro-batches and schedule may differ from the run that wrote it")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a checkpoint.dir that holds another run's step-*.pt files (deletes them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value by dotted key, e.g. model.layers=8 or strategy.options.plan=keep "
                             "(YAML value syntax); repeatable")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config and the devices, print the torchrun command line, start nothing")
    parser.add_argument("--json", action="store_true",
                        help="print the run's summary (losses, step times, peaks, plan) as one JSON line at the end")
    parser.add_argument("--profile-json", metavar="PATH",
                        help="profile one step whatever the plan and write every stage's memory profile to PATH as "
                             "JSON: each saved tensor's size, producer, consumer and lifetime, each stage's peak and "
                             "its device's spare memory under the budget")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted config overrides from ``--set`` and the flags (flags win)."""
    from strategies.training.checks import parse_set_items
    from strategies.mpress.launcher import MPressConfigError

    out = parse_set_items(args.set, MPressConfigError)
    stages = args.stages
    if args.nproc is not None:
        if args.nproc < 1:
            raise MPressConfigError(f"--nproc must be a positive integer, got {args.nproc}")
        if stages is not None and stages != args.nproc:
            raise MPressConfigError(f"--nproc {args.nproc} and --stages {stages} differ: the pipeline runs one process "
                                    f"per stage (no data parallelism yet); give one of them, or the same number")
        stages = args.nproc
    for key, value in (("strategy.options.stages", stages), ("strategy.options.microbatches", args.microbatches),
                       ("strategy.options.schedule", args.schedule), ("steps", args.steps),
                       ("resume", args.resume)):
        if value is not None:
            out[key] = value
    if args.overwrite:
        out["checkpoint.overwrite"] = True
    if args.budget_gb is not None:
        if not args.budget_gb > 0:
            raise MPressConfigError(f"--budget-gb must be a positive number of GB, got {args.budget_gb}")
        out["device_budget"] = int(round(args.budget_gb * 1e9))
    return out


def _rank_args(args: argparse.Namespace) -> list[str]:
    """The flags every rank gets (``--stages`` is added by the launch command, --nproc/--dry-run dropped)."""
    out: list[str] = []
    for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                        ("--budget-gb", args.budget_gb), ("--steps", args.steps),
                        ("--resume", os.path.abspath(args.resume) if args.resume else None)):
        if value is not None:
            out += [flag, str(value)]
    for item in args.set:
        out += ["--set", item]
    if args.overwrite:
        out.append("--overwrite")
    if args.json:
        out.append("--json")
    if args.profile_json is not None:  # absolute: the ranks need not share the caller's idea of "here"
        out += ["--profile-json", os.path.abspath(args.profile_json)]
    return out


def _check_profile_json(path: str | None) -> None:
    """A ``--profile-json`` path must be writable where it points: refused before any process starts."""
    from strategies.mpress.launcher import MPressConfigError

    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent):
        raise MPressConfigError(f"--profile-json {path!r}: "
                                + ("is a directory" if os.path.isdir(path) else f"no directory {parent!r}")
                                + "; give a file path in an existing directory")


def _check_checkpoints(config: Any, backend: Any) -> dict[str, str]:
    """The resume checkpoint against the config and the checkpoint folder: refused before any process
    starts. Returns what the stages' environment gains: the verified checkpoint's mark, so that
    they do not each read the whole file again for its checksum."""
    from pathlib import Path

    from strategies.mpress.checkpointing import check_resume
    from strategies.training import TrainConfigError, resolve_dtype
    from strategies.training.checkpoints import VERIFIED_ENV, check_checkpoint_dir

    t = config.train
    resumed = check_resume(t, config.options(), resolve_dtype(t, backend)[0]) if t.resume else None
    env = {VERIFIED_ENV: resumed[3]} if resumed else {}
    if t.checkpoint is None:
        return env
    check_checkpoint_dir(t, resumed[1]["run_id"] if resumed else "", fresh=resumed is None)
    try:  # an unwritable folder fails now, not after the first hour of training
        Path(t.checkpoint.dir).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainConfigError(f"checkpoint.dir {t.checkpoint.dir!r}: {exc.strerror or exc}") from None
    return env


def run(args: argparse.Namespace) -> int:
    """Check the config; then start the ranks through torchrun, or (under torchrun) run this rank's stage."""
    import subprocess
    import tempfile

    from strategies.mpress.launcher import check_devices, format_command, launch_command, load_config, under_torchrun

    config = load_config(args.config, _overrides(args))
    _check_profile_json(args.profile_json)
    if under_torchrun():
        return _run_rank(config, args)
    import xpu

    backend = xpu.get_backend()
    env = check_devices(config, backend, add_virtual=True)
    env.update(_check_checkpoints(config, backend))
    # torchrun would set 1 thread per process (and warn); share the cores between the stages instead.
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.stages))))
    command = launch_command(args.config, config.stages, _rank_args(args))
    if args.dry_run:
        print(format_command(command, env))
        return 0
    print(f"xpu mpress: starting {config.stages} stage processes: {format_command(command, env)}", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(prefix="xpu-mpress-") as tmp:
        status = os.path.join(tmp, "status")
        try:
            rc = subprocess.run(command, env={**os.environ, **env, _STATUS_ENV: status}).returncode
        except KeyboardInterrupt:
            print("xpu mpress: interrupted", file=sys.stderr)
            return 130
        if rc:
            print(f"xpu mpress: a stage process failed (torchrun exit status {rc}); its error is above", file=sys.stderr)
            return rc
        if os.path.exists(status):
            with open(status) as fh:
                return int(fh.read().strip() or 1)
    return 0


def _run_rank(config: Any, args: argparse.Namespace) -> int:
    """This torchrun rank's stage; errors become one line on stderr (rank 0 for the ones every rank shares)."""
    import torch

    from strategies.mpress.launcher import run_rank
    from strategies.mpress.planner import InfeasibleBudgetError, PlanOverBudgetError
    from strategies.training import CheckpointWriteError, TrainConfigError, TrainingDivergedError
    from xpu.dist import leave_rank
    from xpu.units import format_bytes

    rank = int(os.environ.get("RANK", "0"))
    try:
        run_rank(config, json_out=args.json, profile_json=args.profile_json)
    except InfeasibleBudgetError as exc:  # every rank has it (rank 0 planned and broadcast it): say it once
        if isinstance(exc, PlanOverBudgetError):  # a given plan, measured: found before any training step
            hint = (f"use plan: auto (the planner fits every device to its budget), or raise --budget-gb to at least "
                    f"{format_bytes(max(exc.minimum.values()))}")
        else:
            shared = config.job().shares_devices(config.stages)
            hint = "raise --budget-gb, or " + ("spread the stages over more devices (strategy.options.devices)"
                                               if shared else "add stages so each holds fewer blocks")
        if rank == 0:
            print(f"xpu mpress: error: {exc}; {hint}", file=sys.stderr)
        status = os.environ.get(_STATUS_ENV)
        if status is not None and rank == 0:
            with open(status, "w") as fh:
                fh.write("2")
        # Started by hand under torchrun, the exit status says it; by the launcher, the file.
        leave_rank(2 if status is None else 0)
    except (TrainConfigError, CheckpointWriteError, TrainingDivergedError) as exc:  # a checkpoint not written or read
        print(f"xpu mpress: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        oom = _out_of_memory(exc, torch.OutOfMemoryError)
        if oom is None:
            raise
        first = (str(oom).strip().splitlines() or ["out of memory"])[0]
        print(f"xpu mpress: error: stage {rank} ran out of device memory: {first[:300]}; try plan: auto, a larger "
              f"--budget-gb, more micro-batches or more stages", file=sys.stderr)
        return 3
    return 0


def _out_of_memory(exc: BaseException, oom_type: type) -> BaseException | None:
    """The out-of-memory error behind ``exc``, if any (torch's pipeline schedules re-raise a stage's error wrapped)."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        if isinstance(node, oom_type):
            return node
        seen.add(id(node))
        node = node.__cause__ or node.__context__
    return None


# `xpu <name>`: this module registers itself (the `xpu.commands` entry point in pyproject.toml names it).
register_command("mpress", "strategies.mpress.cli", "MPress pipeline training from a YAML config, one process per stage via torchrun", order=9)
