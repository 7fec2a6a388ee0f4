"""The ``xpu`` command: ``xpu info``, ``xpu probe``, and the commands other packages add.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
this file only lists them, so adding one is one line in :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import XpuError

__all__ = ["COMMANDS", "main"]

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("xpu.commands.info", "backend, devices, memory, capabilities and topology"),
    "probe": ("xpu.commands.probe", "measure link bandwidths and DHA matmul; cache the result"),
    "bench": ("bench.cli", "run systems side by side on one model and memory cap"),
    "train": ("xpu.commands.train", "train a model from a YAML config"),
    "mpress": ("xpu.commands.mpress", "MPress pipeline training from a YAML config, one process per stage via torchrun"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xpu`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="xpu", description="Train models larger than accelerator memory.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's module is imported: one command's heavy or missing imports
    # (the benchmark harness, DeepSpeed) never break another (``xpu info``).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command_parser)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except XpuError as exc:
        print(f"xpu {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
