"""Largest-model search: per system, the largest model of the scenario's family that trains.

"Trains" means ``max_model.warmup + max_model.steps`` steps run without error under the
scenario's device cap (``device_mem_gb``) and host cap (``host_mem_gb``). One size knob
grows (``layers``, or ``hidden`` in steps of ``heads * 8`` with heads fixed); the rest of
the model stays as the scenario says. Every trial runs in a fresh worker process.

The search doubles the knob from ``lo`` until a trial fails (or ``hi`` is reached), then
bisects between the last success and the first failure. It starts from ``lo`` whatever the
cap, so when "fits" is monotone in the knob (a bigger model never fits where a smaller one
does not) the result is exactly the largest fitting value, and a larger cap never yields a
smaller model.

Every finished trial is appended to ``max_model_trials.jsonl`` in the output folder, keyed by
the machine and the trial's whole scenario. A search run again into the same folder takes
its finished trials from there instead of repeating them, so a search longer than one device
call's time limit goes on where the last call stopped.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable

from .scenario import Scenario, load_scenario
from .search import TrialJournal, run_searches, run_trial, search_largest
from .systems import get_system, missing_requirement

__all__ = ["search_largest", "max_model_for_system", "run_max_model", "dims_for", "TrialJournal"]

#: File, in the output folder, where finished trials are kept for reruns (:func:`bench.search.run_searches`).
JOURNAL_NAME = "max_model_trials.jsonl"


def dims_for(scenario: Scenario, value: int) -> dict[str, Any]:
    """The scenario's model dimensions with the knob set to ``value`` (layers, or hidden units)."""
    model = copy.deepcopy(scenario.model)
    knob = scenario.max_model.knob
    if knob == "layers":
        model["layers"] = value
    elif knob == "hidden":
        model["hidden"] = value
        model.pop("ffn", None)  # let the MLP width follow the hidden size
    return model


def knob_values(scenario: Scenario) -> tuple[int, int, int]:
    """``(lo, hi, unit)``: the search range in knob units and the size of one unit."""
    mm = scenario.max_model
    if scenario.family == "hf":
        raise ValueError("max-model search needs a gpt or llama family (hf configs have no single size knob here)")
    if mm.knob == "layers":
        return mm.lo, mm.hi, 1
    unit = int(scenario.model["heads"]) * 8
    lo, hi = math.ceil(mm.lo / unit), mm.hi // unit
    if hi < max(lo, 1):
        raise ValueError(f"max_model: hidden range [{mm.lo}, {mm.hi}] holds no multiple of heads*8 = {unit}")
    return max(lo, 1), hi, unit


def _resolution_in_units(resolution: int, unit: int) -> int:
    """The resolution, given in the knob's own measure (layers or hidden units), in search steps."""
    return max(1, resolution // unit)


def _trial_scenario(scenario: Scenario, label: str, value: int) -> Scenario:
    mm = scenario.max_model
    trial = copy.deepcopy(scenario)
    trial.model = dims_for(scenario, value)
    trial.steps, trial.warmup, trial.loss_after = mm.steps, mm.warmup, None
    trial.timeline = False
    trial.systems = [e for e in trial.systems if e.label == label]
    entry = trial.systems[0]
    entry.steps, entry.warmup = None, None
    trial.validate()
    return trial


def max_model_for_system(scenario: Scenario, label: str, out_dir: Path | None = None, *, spawn: bool = True,
                         on_trial: Callable[[dict[str, Any]], None] | None = None,
                         journal: TrialJournal | None = None) -> dict[str, Any]:
    """Search the largest trainable model for one system of ``scenario``; return its row.

    Args:
        spawn: run each trial in a fresh worker process (the default, and what ``xpu bench``
            does); False runs trials in this process (fast tests on the cpu backend).
        on_trial: called with each trial's summary as it finishes.
        journal: finished trials to reuse and to add to (None: every trial runs).
    """
    from strategies.models import param_count

    entry = scenario.entry(label)
    spec = get_system(entry.name)
    lo, hi, unit = knob_values(scenario)
    base = {"system": label, "system_name": entry.name, "approximate": spec.approximate, "options": entry.options,
            "family": scenario.family, "knob": scenario.max_model.knob, "device_mem_gb": scenario.device_mem_gb,
            "host_mem_gb": scenario.host_mem_gb, "knob_range": [lo * unit, hi * unit],
            "resolution": scenario.max_model.resolution, "max_params": None, "max_config": None, "max_value": None,
            "trials": [], "best_row": None, "reason": None}
    missing = missing_requirement(spec)
    if missing:
        return {**base, "status": "missing", "reason": missing}
    trials: dict[int, dict[str, Any]] = {}
    stop: dict[str, Any] = {}

    def fits(k: int) -> bool:
        if stop:
            return False
        value = k * unit
        trial = _trial_scenario(scenario, label, value)
        row, reused = run_trial(trial, label, out_dir, spawn=spawn, journal=journal, log_name=f"maxmodel-{label}-{value}")
        params = row.get("params") or param_count(trial.family, **trial.model_dims())
        summary = {"value": value, "params": params, "status": row["status"], "step_s": row.get("step_s"),
                   "peak_device_gb": row.get("peak_device_gb"), "peak_host_gb": row.get("peak_host_gb")}
        if reused:
            summary["reused"] = True
        if row["status"] != "ok":
            summary["reason"] = (row.get("reason") or "")[:300]
        trials[k] = {**summary, "row": row}
        base["trials"].append(summary)
        if on_trial:
            on_trial(summary)
        if row["status"] == "missing":
            stop.update(status="missing", reason=row.get("reason"))
        return row["status"] == "ok"

    best = search_largest(fits, lo, hi, _resolution_in_units(scenario.max_model.resolution, unit))
    if stop:
        return {**base, "status": stop["status"], "reason": stop["reason"]}
    if best is None:
        first = trials[lo]
        status = "oom" if first["status"] == "oom" else "error"
        return {**base, "status": status, "reason": f"even {scenario.max_model.knob}={lo * unit} does not train: "
                                                    f"{first.get('reason', '')}"}
    row = trials[best]["row"]
    keep = ("step_s", "step_mean_s", "tokens_per_s", "tflops", "peak_device_gb", "peak_device_reserved_gb", "peak_host_gb",
            "loss", "dtype")
    out = {**base, "status": "ok", "max_value": best * unit, "max_params": trials[best]["params"],
           "max_config": {k: v for k, v in dims_for(scenario, best * unit).items()},
           "best_row": {k: row.get(k) for k in keep}}
    gap = next((k for k in sorted(trials) if k > best and trials[k]["status"] != "ok"), None)
    if gap is not None and gap - best > 1:
        out["reason"] = (f"bisection stopped at resolution {scenario.max_model.resolution}: {scenario.max_model.knob}="
                         f"{gap * unit} does not train, the values between were not tried")
    if best == hi:
        out["reason"] = f"reached the top of the search range ({scenario.max_model.knob}={hi * unit}); raise max_model.hi"
    return out


def run_max_model(scenario: Scenario | str | Path | dict[str, Any], out_dir: str | Path | None = None, *,
                  systems: list[str] | None = None, progress: bool = True, command: str | None = None,
                  spawn: bool = True) -> dict[str, Any]:
    """Run the largest-model search for every system of ``scenario``; write ``max_model.json``/``.md``.

    Returns the result dict: ``{"machine", "date", "command", "scenario", "rows": [...]}`` where
    each row carries ``max_params``, ``max_config`` and its ``trials``.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    if systems:
        scenario = scenario.select(systems)
    try:
        knob_values(scenario)
    except ValueError as exc:
        from .scenario import ScenarioError

        raise ScenarioError(str(exc)) from None
    mm = scenario.max_model

    def one(label: str, out: Path, *, info: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return max_model_for_system(scenario, label, out, spawn=spawn, **kw)  # the knob range does not need info

    return run_searches(scenario, out_dir, stem="max_model", title="largest model per system", spawn=spawn,
                        progress=progress, command=command or f"run_max_model({scenario.name!r})", search_one=one,
                        trial_text=lambda t: f"{mm.knob}={t['value']} {t['status']}",
                        row_text=lambda r: r["status"] + (f" max {r['max_params'] / 1e9:.3g} B params"
                                                          if r.get("max_params") else ""))
