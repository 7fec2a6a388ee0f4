"""``python -m xpu`` runs the ``xpu`` command."""
import sys

from .cli import main

sys.exit(main())
