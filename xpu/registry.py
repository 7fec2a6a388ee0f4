"""Which backend runs: ``XPU_BACKEND`` if set, else the highest-priority usable one.

Backends register a lazy factory (``"module:Class"``) with a priority; nothing is imported
until a backend is asked for. Why a backend could not be used is remembered and reported,
so ``XPU_BACKEND=cuda`` on a machine without CUDA says what is missing instead of silently
falling back. Adding a backend means one new file in ``backends/`` and one
``register_backend`` line in ``backends/__init__.py``; another package adds its own through an
``xpu.backends`` entry point (:mod:`xpu.plugins`). This module imports no backend itself: the
in-tree ones are found through this project's own ``xpu.backends`` entry point.
"""
from __future__ import annotations

import logging
import os
import threading

from .backend import Backend
from .errors import BackendUnavailableError, UnknownBackendError
from .plugins import Plugin, PluginRegistry, load_target

__all__ = ["BACKENDS", "register_backend", "registered_backends", "backend_status", "get_backend", "reset_backend", "ENV_VAR"]

#: The environment variable that picks a backend by name.
ENV_VAR = "XPU_BACKEND"

_log = logging.getLogger("xpu")


#: The backends: in-tree ones and any another package adds (entry-point group ``xpu.backends``).
BACKENDS = PluginRegistry("backend", group="xpu.backends")
_lock = threading.RLock()
_active: Backend | None = None


def register_backend(name: str, target: str, *, priority: int = 0) -> None:
    """Register a backend factory.

    Args:
        name: the value of ``XPU_BACKEND`` that selects it.
        target: ``"package.module:ClassName"`` of a :class:`~xpu.backend.Backend` subclass
            with a ``unavailable_reason()`` classmethod (None when usable).
        priority: auto-detection tries higher priorities first.
    """
    BACKENDS.register(name, target, priority=priority)


def registered_backends() -> list[str]:
    """Names of all registered backends, highest priority first."""
    return BACKENDS.names()


def _load_class(entry: Plugin) -> type[Backend]:
    return load_target(entry.target)


def _why_unusable(entry: Plugin) -> str | None:
    try:
        cls = _load_class(entry)
    except Exception as exc:  # an import error is exactly the reason we want to report
        return f"its module could not be imported ({type(exc).__name__}: {exc})"
    return cls.unavailable_reason()


def backend_status() -> dict[str, str | None]:
    """For every registered backend, None if usable here, else why not."""
    return {name: _why_unusable(plugin) for name, plugin in BACKENDS.plugins().items()}


def _create(name: str) -> Backend:
    plugins = BACKENDS.plugins()
    if name not in plugins:
        known = ", ".join(sorted(plugins)) or "none are registered: install the package (`pip install -e .`)"
        raise UnknownBackendError(f"{ENV_VAR}={name!r} is not a known backend; valid values: {known} "
                                  f"(or leave {ENV_VAR} unset to auto-detect)")
    reason = _why_unusable(plugins[name])
    if reason is not None:
        raise BackendUnavailableError(f"backend '{name}' is not usable here: {reason}")
    return _load_class(plugins[name])()


def get_backend(name: str | None = None) -> Backend:
    """The process's backend, created on first call.

    Args:
        name: a backend name; None reads ``XPU_BACKEND``, and if that is unset too, picks the
            highest-priority usable backend (an NPU, then a CUDA GPU, else the cpu reference
            with a one-line warning).

    Raises:
        UnknownBackendError: the name is not registered; the message lists valid names.
        BackendUnavailableError: the named backend cannot run here; the message says why.
    """
    global _active
    with _lock:
        wanted = name or os.environ.get(ENV_VAR) or None
        if _active is not None and (wanted is None or wanted == _active.name):
            return _active
        if wanted is not None:
            _active = _create(wanted.strip().lower())
            return _active
        reasons = {}
        for candidate, plugin in BACKENDS.plugins().items():
            reason = _why_unusable(plugin)
            if reason is None:
                _active = _load_class(plugin)()
                if reasons and plugin.priority <= 0:  # a last-resort backend: say so
                    _log.warning("xpu: no %s usable; using the '%s' backend (`xpu info` says why)",
                                 " or ".join(reasons), candidate)
                return _active
            reasons[candidate] = reason
        if not reasons:
            raise BackendUnavailableError("no backend is registered: install the package (`pip install -e .`), "
                                          "whose xpu.backends entry point registers the in-tree ones")
        raise BackendUnavailableError("no registered backend is usable: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))


def reset_backend() -> None:
    """Forget the active backend (tests, or after changing ``XPU_BACKEND``)."""
    global _active
    with _lock:
        _active = None
