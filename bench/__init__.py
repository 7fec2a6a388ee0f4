"""The benchmark harness: our strategies against DeepSpeed, FSDP2 and plain PyTorch, side by side.

    xpu bench examples/bench/design-s3.yaml        # CLI
    from bench import run_bench                    # the same from Python
    result = run_bench("examples/bench/tiny.yaml", out_dir="/tmp/bench")

Modules: :mod:`strategies.models` (GPT, Llama-style, Hugging Face; parameter and FLOP counts),
:mod:`bench.scenario` (YAML scenarios), :mod:`bench.systems` (the registry; one file per
baseline family), :mod:`bench.worker` (one system in one fresh process),
:mod:`bench.runner` (systems one after another), :mod:`bench.maxmodel` (largest model
that trains under caps), :mod:`bench.mincap` (smallest device cap a system trains under),
:mod:`bench.search` (what the two searches share: monotone searches, journaled trials),
:mod:`bench.report` (JSON, markdown, plot, timelines), :mod:`bench.cli` (``xpu bench``), :mod:`bench.transfers` (:mod:`scaleup`'s transfer
benchmarks and bandwidth predictions).
"""
from __future__ import annotations

from typing import Any

from .scenario import Scenario, ScenarioError, SystemEntry, load_scenario
from .systems import register_system, registered_systems

__all__ = ["run_bench", "run_max_model", "run_min_cap", "Scenario", "SystemEntry", "ScenarioError", "load_scenario",
           "register_system", "registered_systems"]


def run_bench(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run a scenario's systems side by side; see :func:`bench.runner.run_bench`."""
    from .runner import run_bench as _run

    return _run(*args, **kwargs)


def run_max_model(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Largest model per system under the caps; see :func:`bench.maxmodel.run_max_model`."""
    from .maxmodel import run_max_model as _run

    return _run(*args, **kwargs)


def run_min_cap(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Smallest device cap per system; see :func:`bench.mincap.run_min_cap`."""
    from .mincap import run_min_cap as _run

    return _run(*args, **kwargs)
