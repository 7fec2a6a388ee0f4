"""Subcommands of the ``xpu`` CLI, one module each (see :data:`xpu.cli.COMMANDS`)."""
