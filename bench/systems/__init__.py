"""Registry of benchmarked systems: built-in baselines plus whatever our strategies register.

A system is a name bound lazily to a factory ``"package.module:callable"``; nothing is
imported until a worker process runs it. The factory takes a
:class:`~bench.systems.base.SystemContext` and returns a
:class:`~bench.systems.base.BenchSystem` (one training step per ``step()`` call).

How a strategy adds itself, without changing the harness: in its own package, a module
``strategies/<name>/bench.py`` (imported by discovery) or an entry point in the
``xpu.bench_systems`` group (``name = "pkg.module:factory"``) does::

    from bench.systems import register_system

    register_system(
        "memferry",                               # the name scenarios use
        "strategies.memferry.bench_system:make",  # factory(ctx) -> BenchSystem, imported lazily
        options={"reserve_gb": 0.0},              # accepted options and their defaults
        description="MemFerry: host-homed parameters, DHA + prefetch",
    )

Discovery imports ``strategies``, then ``strategies.<sub>.bench`` for every subpackage that
has one, then the entry points. A registration module that fails to import is reported
(:func:`discovery_errors`) and skipped; the other systems still run.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import threading
import traceback
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

__all__ = [
    "SystemSpec", "register_system", "registered_systems", "get_system", "load_factory",
    "missing_requirement", "discovery_errors", "ENTRY_POINT_GROUP",
]

#: Entry-point group other packages use to register systems.
ENTRY_POINT_GROUP = "xpu.bench_systems"


@dataclass(frozen=True)
class SystemSpec:
    """One registered system.

    Attributes:
        name: the name scenarios and ``--systems`` use.
        target: ``"module:callable"``; the callable takes a ``SystemContext``, returns a ``BenchSystem``.
        approximate: its updates are not exact (e.g. stale); rows say so and loss must be read too.
        requires: top-level packages it imports; if one is not installed its row is "missing".
        options: accepted options with their defaults (unknown options are errors before anything runs).
        description: one line for ``xpu bench --list-systems``.
        period_option: for systems with periodically slow steps, the option holding the
            period; the harness rounds its timed steps up to whole periods so that the mean
            step time covers whole update intervals.
    """

    name: str
    target: str
    approximate: bool = False
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    period_option: str | None = None


_systems: dict[str, SystemSpec] = {}
_errors: list[str] = []
_discovered = False
_lock = threading.RLock()


def register_system(name: str, target: str, *, approximate: bool = False, requires: tuple[str, ...] | list[str] = (),
                    options: dict[str, Any] | None = None, description: str = "",
                    period_option: str | None = None) -> None:
    """Register (or replace) a benchmarked system.

    Args:
        name: scenario name of the system, e.g. ``"memferry"``.
        target: ``"package.module:factory"``; imported only inside the worker that runs it.
        approximate: True for systems whose updates are approximate (rows carry the flag).
        requires: packages that must be importable (e.g. ``("deepspeed",)``); when one is
            missing the row says "missing" with the package named, without starting a worker.
        options: accepted per-system options and defaults.
        description: one line of help.
        period_option: name of the option giving the period of slow steps (see :class:`SystemSpec`).

    Raises:
        ValueError: ``target`` is not of the form ``"module:callable"``.
    """
    if ":" not in target:
        raise ValueError(f"system target must be 'package.module:callable', got {target!r}")
    with _lock:
        _systems[name] = SystemSpec(name, target, approximate, tuple(requires), dict(options or {}), description,
                                    period_option)


# The built-in baselines (DESIGN.md §3). Options are validated against these defaults. Option
# "ranks" (1: one process) runs a baseline data-parallel on that many devices (bench/systems/multirank.py).
register_system("torch", "bench.systems.torch_ref:make",
                options={"precision": "pure", "recompute": False, "fused": True, "optimizer": True},
                description="plain PyTorch, everything on the device, fused AdamW (bf16 weights and states by default)")
register_system("fsdp2-offload", "bench.systems.fsdp2:make",
                options={"pin_memory": True, "fused": True, "reshard_after_forward": True, "ranks": 1},
                description="PyTorch FSDP2 fully_shard per block + root, CPUOffloadPolicy, bf16 compute, fp32 params")
register_system("deepspeed-z2-offload", "bench.systems.deepspeed_offload:make_z2", requires=("deepspeed",),
                options={"config": {}, "ranks": 1},
                description="DeepSpeed ZeRO-2, optimizer offloaded to CPU (DeepSpeedCPUAdam)")
register_system("deepspeed-z3-offload", "bench.systems.deepspeed_offload:make_z3", requires=("deepspeed",),
                options={"config": {}, "ranks": 1},
                description="DeepSpeed ZeRO-3, parameters and optimizer offloaded to CPU, model built under zero.Init")
register_system("deepspeed-twinflow", "bench.systems.deepspeed_offload:make_twinflow", requires=("deepspeed",),
                options={"ratio": 0.5, "config": {}, "ranks": 1},
                description="DeepSpeed ZeRO-3 Twin-Flow: a `ratio` of optimizer states updated on CPU, the rest on device")
register_system("deepspeed-zenflow", "bench.systems.deepspeed_offload:make_zenflow", requires=("deepspeed",),
                approximate=True,
                options={"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "auto", "select_interval": "auto",
                         "full_warm_up_rounds": 0, "overlap_step": True, "config": {}, "ranks": 1},
                period_option="update_interval",
                description="DeepSpeed ZeRO-2 offload + ZenFlow (approximate: stale updates by design; read its loss)")


def _discover() -> None:
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True
        # Our strategies register themselves from strategies/<name>/bench.py.
        try:
            pkg = importlib.import_module("strategies")
        except ImportError:
            pkg = None
        if pkg is not None and hasattr(pkg, "__path__"):
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
                if not info.ispkg:
                    continue
                module = f"strategies.{info.name}.bench"
                try:
                    if importlib.util.find_spec(module) is not None:
                        importlib.import_module(module)
                except Exception as exc:  # a broken strategy must not take the baselines down
                    _errors.append(f"{module}: {type(exc).__name__}: {exc}")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _systems:
                continue
            try:
                loaded = ep.load()
            except Exception as exc:
                _errors.append(f"entry point {ep.name} ({ep.value}): {type(exc).__name__}: {exc}")
                continue
            # An entry point may name a factory directly, or a registration function to call.
            if getattr(loaded, "__bench_register__", False):
                loaded()
            else:
                register_system(ep.name, ep.value)


def discovery_errors() -> list[str]:
    """Registration modules that failed to import during discovery (each with its error)."""
    _discover()
    return list(_errors)


def registered_systems() -> dict[str, SystemSpec]:
    """All registered systems by name (built-ins first, then discovered ones)."""
    _discover()
    return dict(_systems)


def get_system(name: str) -> SystemSpec:
    """The registered system called ``name``.

    Raises:
        KeyError: no such system; the message lists the valid names.
    """
    systems = registered_systems()
    if name not in systems:
        raise KeyError(f"unknown system {name!r}; valid systems: {', '.join(systems)}")
    return systems[name]


def load_factory(spec: SystemSpec) -> Callable[..., Any]:
    """Import and return the factory of ``spec`` (this is where its packages get imported)."""
    module_name, _, attr = spec.target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def missing_requirement(spec: SystemSpec, extra: tuple[str, ...] = ()) -> str | None:
    """A sentence naming the first required package that is not installed, or None."""
    for package in (*spec.requires, *extra):
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"package '{package}' is not installed (needed by {spec.name})"
    return None


def format_exception(exc: BaseException, limit: int = 6) -> str:
    """A short, one-paragraph description of ``exc`` with the innermost frames."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-limit)
    return "".join(tb).strip()
