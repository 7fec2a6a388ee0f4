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
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xpu`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="xpu", description="Train models larger than accelerator memory.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = modules[name] = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except XpuError as exc:
        print(f"xpu {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
