"""Named plugins bound lazily to ``"module:attr"`` targets: the one registry helper.

Backends (``xpu.backends``), ``xpu`` subcommands (``xpu.commands``), benchmarked systems and
training strategies all register the same way: a name, a target string, a priority and any
metadata the owner needs. Nothing is imported until a plugin is loaded, and why a plugin or a
registration module failed to load is remembered and reported, never swallowed.

Owners register themselves. Discovery loads the registry's entry-point group, where an entry
point is either

- a module (``builtin = "backends"``): importing it runs its ``register`` calls, or
- a target (``fancy = "pkg.mod:Thing"``): registered under the entry point's name as it is.

So a layer never imports the layers above it: the packaging metadata (``pyproject.toml``) says
who registers what, and the registry reads it.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

__all__ = ["Plugin", "PluginRegistry", "load_target"]


@dataclass(frozen=True)
class Plugin:
    """One registered plugin.

    Attributes:
        name: the name users select it by.
        target: ``"package.module:attribute"``, imported only by :meth:`PluginRegistry.load`.
        priority: higher first in :meth:`PluginRegistry.names` (e.g. backend auto-detection order).
        meta: whatever else the owner registered with it (options, help text, ...).
    """

    name: str
    target: str
    priority: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def load_target(target: str) -> Any:
    """Import ``"package.module:attribute"`` and return the attribute.

    Raises:
        ValueError: ``target`` has no ``:``.
        ImportError, AttributeError: the module or attribute is missing.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"a plugin target must be 'package.module:attribute', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class PluginRegistry:
    """Plugins of one kind, discovered from an entry-point group on first use.

    Args:
        kind: what the plugins are, for messages (``"backend"``, ``"command"``).
        group: the entry-point group read at discovery (None: registrations in code only).
    """

    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind = kind
        self.group = group
        self._plugins: dict[str, Plugin] = {}
        self._errors: list[str] = []
        self._discovered = False
        self._lock = threading.RLock()

    def register(self, name: str, target: str, *, priority: int = 0, **meta: Any) -> None:
        """Register (or replace) plugin ``name`` bound to ``target``; ``meta`` is kept on the :class:`Plugin`.

        Raises:
            ValueError: ``target`` is not of the form ``"package.module:attribute"``.
        """
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"{self.kind} target must be 'package.module:attribute', got {target!r}")
        with self._lock:
            self._plugins[name] = Plugin(name, target, priority, dict(meta))

    def _discover(self) -> None:
        with self._lock:
            if self._discovered or self.group is None:
                return
            self._discovered = True
            for ep in sorted(entry_points(group=self.group), key=lambda e: e.name):
                if ep.attr:  # a target, registered under the entry point's name
                    if ep.name not in self._plugins:
                        self.register(ep.name, ep.value)
                    continue
                try:  # a module that registers its own plugins when imported
                    importlib.import_module(ep.module)
                except Exception as exc:  # reported, so one broken owner does not hide the others
                    self._errors.append(f"{ep.module} (entry point {ep.name!r} of {self.group}): "
                                        f"{type(exc).__name__}: {exc}")

    def plugins(self) -> dict[str, Plugin]:
        """Every plugin by name, highest priority first (registration order among equals)."""
        self._discover()
        with self._lock:
            ordered = sorted(self._plugins.values(), key=lambda p: -p.priority)
            return {p.name: p for p in ordered}

    def names(self) -> list[str]:
        """Plugin names, highest priority first."""
        return list(self.plugins())

    def get(self, name: str) -> Plugin:
        """The plugin called ``name``.

        Raises:
            KeyError: no such plugin; the message lists the valid names.
        """
        plugins = self.plugins()
        if name not in plugins:
            valid = ", ".join(sorted(plugins)) or "none registered"
            hint = f" (is the package installed? `pip install -e .` registers its {self.group} entry points)" \
                if not plugins and self.group else ""
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {valid}{hint}")
        return plugins[name]

    def load(self, name: str) -> Any:
        """Import and return the target of plugin ``name`` (this is where its modules get imported)."""
        return load_target(self.get(name).target)

    def errors(self) -> list[str]:
        """Registration modules that failed to import during discovery, each with its error."""
        self._discover()
        return list(self._errors)
