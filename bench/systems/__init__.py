"""Registry of benchmarked systems: the baselines and our strategies, one registration line each.

A system is a name bound lazily to a factory ``"package.module:callable"`` (an
:class:`xpu.plugins.PluginRegistry`); nothing is imported until a worker process runs it. The
factory takes a :class:`~bench.systems.base.SystemContext` and returns a
:class:`~bench.systems.base.BenchSystem` (one training step per ``step()`` call). Each system's
adapter is one file in this folder; another package adds systems through the
``xpu.bench_systems`` entry-point group: a ``"pkg.module:factory"`` entry is registered under
its name, and a module entry is imported so that its own :func:`register_system` calls run::

    from bench.systems import register_system

    register_system("mysys", "mypkg.bench_adapter:make",   # factory(ctx) -> BenchSystem, imported lazily
                    options={"scale": 1.0},                 # accepted options and their defaults
                    description="one line for --list-systems")

A registration module that fails to import is reported (:func:`discovery_errors`) and
skipped; the other systems still run.
"""
from __future__ import annotations

import importlib.util
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from xpu.plugins import PluginRegistry, load_target

__all__ = [
    "SystemSpec", "SYSTEMS", "register_system", "registered_systems", "get_system", "load_factory",
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
        accumulation: the system honours the scenario's ``accumulation_steps`` (its ``step``
            then gets ``N * batch`` rows: N micro-batches of ``batch`` rows, one optimizer
            update, the mean micro-batch loss returned); a scenario asking N > 1 of a system
            without it is refused before anything runs.
        accumulation_hint: what that refusal suggests instead (one sentence).
    """

    name: str
    target: str
    approximate: bool = False
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    period_option: str | None = None
    accumulation: bool = False
    accumulation_hint: str = ""


#: Every system, with its :class:`SystemSpec` in the plugin's ``spec`` metadata.
SYSTEMS = PluginRegistry("system", group=ENTRY_POINT_GROUP)


def register_system(name: str, target: str, *, approximate: bool = False, requires: tuple[str, ...] | list[str] = (),
                    options: dict[str, Any] | None = None, description: str = "",
                    period_option: str | None = None, accumulation: bool = False,
                    accumulation_hint: str = "") -> None:
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
        accumulation, accumulation_hint: the system honours ``accumulation_steps`` (see :class:`SystemSpec`).

    Raises:
        ValueError: ``target`` is not of the form ``"module:callable"``.
    """
    SYSTEMS.register(name, target, spec=SystemSpec(name, target, approximate, tuple(requires), dict(options or {}),
                                                   description, period_option, accumulation, accumulation_hint))


# The built-in baselines (docs/design.md §3). Options are validated against these defaults. Option
# "ranks" (1: one process) runs a baseline data-parallel on that many devices (bench/systems/multirank.py).
register_system("torch", "bench.systems.torch_ref:make",
                options={"precision": "pure", "recompute": False, "fused": True, "optimizer": True},
                accumulation=True,
                description="plain PyTorch, everything on the device, fused AdamW (bf16 weights and states by default)")
register_system("fsdp2-offload", "bench.systems.fsdp2:make",
                options={"pin_memory": True, "fused": True, "reshard_after_forward": True, "recompute": False, "ranks": 1},
                accumulation=True,
                description="PyTorch FSDP2 fully_shard per block + root, CPUOffloadPolicy, bf16 compute, fp32 params")
register_system("deepspeed-z2-offload", "bench.systems.deepspeed_offload:make_z2", requires=("deepspeed",),
                options={"config": {}, "recompute": False, "ranks": 1},
                accumulation=True,
                description="DeepSpeed ZeRO-2, optimizer offloaded to CPU (DeepSpeedCPUAdam)")
register_system("deepspeed-z3-offload", "bench.systems.deepspeed_offload:make_z3", requires=("deepspeed",),
                options={"config": {}, "recompute": False, "ranks": 1},
                accumulation=True,
                description="DeepSpeed ZeRO-3, parameters and optimizer offloaded to CPU, model built under zero.Init")
register_system("deepspeed-twinflow", "bench.systems.deepspeed_offload:make_twinflow", requires=("deepspeed",),
                options={"ratio": 0.5, "config": {}, "recompute": False, "ranks": 1},
                accumulation=True,
                description="DeepSpeed ZeRO-3 Twin-Flow: a `ratio` of optimizer states updated on CPU, the rest on device")
register_system("deepspeed-zenflow", "bench.systems.deepspeed_offload:make_zenflow", requires=("deepspeed",),
                approximate=True,
                options={"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "auto", "select_interval": "auto",
                         "full_warm_up_rounds": 0, "overlap_step": True, "config": {}, "recompute": False,
                         "ranks": 1},
                period_option="update_interval",
                accumulation=True,
                description="DeepSpeed ZeRO-2 offload + ZenFlow (approximate: stale updates by design; read its loss)")

# Ours.
register_system("memferry", "bench.systems.memferry:make",
                options={"plan": "prefetch+recompute", "max_grad_norm": None, "clip_mode": "speculative",
                         "host_threads": None, "host_kernel": "auto", "host_order": "deadline", "loss_chunks": 1, "memory_margin": 0.10, "measure": "step",
                         "lora": None, "export_hf": False, "allocator_cap": "plan", "sum_placement": "race",
                         "landing_wait": "spin", "clip_fire_rate": 0.0, "flat_sends": False,
                         "split_update": None, "loss_grad_in_forward": True, "gil_switch_s": None,
                         "host_piece": None, "freeze_setup": None, "compile_blocks": False},
                accumulation=True,
                description="MemFerry: parameters homed in host memory; per-block prefetch / DHA / device-homed plans")
register_system("memferry-dp", "bench.systems.memferry_dp:make",
                options={"ranks": 2, "plan": "prefetch+recompute", "max_grad_norm": None, "clip_mode": "speculative",
                         "loss_chunks": 1,
                         "host_threads": None, "host_kernel": "auto", "memory_margin": 0.10},
                accumulation=True,
                description="MemFerry data parallel: one rank process per device, the scenario's batch split between "
                            "them, gradients averaged, host optimizer sharded by rank")
register_system("mpress", "bench.systems.mpress:make",
                options={"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "auto"},
                accumulation_hint="its pipeline accumulates over its own micro-batches: write batch: N * batch "
                                  "and options.microbatches: N * microbatches for the same global batch",
                description="MPress: pipeline stages in their own processes (one device each), activations kept, "
                            "recomputed, host- or peer-swapped per block by the planner")


def discovery_errors() -> list[str]:
    """Registration modules that failed to import during discovery (each with its error)."""
    return SYSTEMS.errors()


def registered_systems() -> dict[str, SystemSpec]:
    """All registered systems by name (in registration order; entry points' after ours)."""
    return {name: plugin.meta.get("spec") or SystemSpec(name, plugin.target) for name, plugin in SYSTEMS.plugins().items()}


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
    return load_target(spec.target)


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
