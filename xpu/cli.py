"""The ``xpu`` command: ``xpu info``, ``xpu probe``, and the commands other packages add.

A subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``. This layer
knows only its own two; the layers above add theirs by registering with
:func:`register_command` from a module named in the ``xpu.commands`` entry-point group
(``pyproject.toml``: ``train`` from the training package, ``mpress``, ``bench``), so ``xpu``
imports nothing above itself.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import XpuError
from .plugins import PluginRegistry

__all__ = ["COMMANDS", "register_command", "main"]

#: Subcommands: name -> ``"module:run"``, with ``help`` in the plugin's metadata.
COMMANDS = PluginRegistry("command", group="xpu.commands")


def register_command(name: str, module: str, help: str, *, order: int = 0) -> None:
    """Add ``xpu NAME``, implemented by ``module`` (its ``add_arguments`` and ``run``).

    Args:
        name: the subcommand.
        module: dotted module name; imported only when ``name`` is the command given.
        help: one line for ``xpu --help``.
        order: listing position in ``xpu --help`` (higher first).
    """
    COMMANDS.register(name, f"{module}:run", priority=order, help=help)


register_command("info", "xpu.commands.info", "backend, devices, memory, capabilities and topology", order=20)
register_command("probe", "xpu.commands.probe", "measure links, host memory and DHA matmul; cache the result", order=19)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xpu`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    epilog = "".join(f"\n(a command failed to register: {e})" for e in COMMANDS.errors()) or None
    parser = argparse.ArgumentParser(prog="xpu", description="Train models larger than accelerator memory.",
                                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's module is imported: one command's heavy or missing imports
    # (the benchmark harness, DeepSpeed) never break another (``xpu info``).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, plugin in COMMANDS.plugins().items():
        help_text = plugin.meta.get("help", "")
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(plugin.target.partition(":")[0])
            module.add_arguments(command_parser)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except XpuError as exc:
        print(f"xpu {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
