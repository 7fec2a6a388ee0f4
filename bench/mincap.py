"""Smallest-cap search: per system, the smallest device cap under which it trains the scenario.

"Trains" means the entry's ``warmup + steps`` steps run without error (as ``xpu bench`` would
run them; the scenario's ``loss_after`` is kept only where it falls within them) under a device
cap of ``device_mem_gb`` (10^9 B) and the scenario's host cap. Every trial runs in a fresh worker.

Caps tried are ``min_cap.lo + k * min_cap.resolution`` and the top, ``min_cap.hi`` (None: no cap
at all, the device's whole memory). The search (:func:`bench.search.search_smallest`) runs the
top first; the peak device memory that trial allocated is a floor no cap below can beat for a
system whose allocations do not depend on the cap (FSDP2, DeepSpeed), so the next trial is the
smallest cap at or above it, then the one just below (or above, if it failed); bisection between
the closest pass and failure settles the rest. When "trains" is monotone in the cap (more memory
never breaks a run that fits in less) the answer is the smallest passing cap of the grid.

Each system's row is the full row of its passing trial at the smallest cap (step time, peaks,
loss, notes), plus ``min_cap_gb``, ``failed_below`` (the cap just below that failed, and why) and
its ``trials``: rows that sit beside an ordinary run's (``xpu bench --merge``). Trials are
journaled in ``min_cap_trials.jsonl`` (:class:`bench.search.TrialJournal`): a search run again
into the same folder goes on where a cut-off one stopped.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable

from .scenario import Scenario, ScenarioError, load_scenario
from .search import TrialJournal, run_searches, run_trial, search_smallest
from .systems import get_system, missing_requirement

__all__ = ["CapGrid", "min_cap_for_system", "run_min_cap"]


class CapGrid:
    """The caps a search may try: index k in [0, top] is ``lo + k * resolution`` GB, the top is
    ``hi`` (None: uncapped, standing for ``device_gb``)."""

    def __init__(self, lo: float, hi: float | None, resolution: float, device_gb: float | None) -> None:
        top_gb = hi if hi is not None else device_gb
        if top_gb is None or top_gb <= lo:
            raise ScenarioError(f"min_cap.lo ({lo} GB) must be below the top of the search "
                                f"({top_gb} GB{'' if hi is not None else ': the device memory'})")
        self.lo, self.hi, self.resolution, self.top_gb = float(lo), hi, float(resolution), float(top_gb)
        self.top = max(1, math.ceil((self.top_gb - self.lo) / self.resolution - 1e-9))
        self.lo_fails = self.lo == 0  # nothing trains in no memory: never tried

    def cap(self, k: int) -> float | None:
        """The cap of index ``k`` in GB (None: uncapped)."""
        if k >= self.top:
            return None if self.hi is None else float(self.hi)
        return round(self.lo + k * self.resolution, 6)

    def at_or_above(self, gb: float) -> int:
        """The index of the smallest cap at or above ``gb``."""
        return min(self.top, max(0, math.ceil((gb - self.lo) / self.resolution - 1e-9)))

    def text(self, k: int) -> str:
        """``"18 GB"``, or ``"uncapped"``."""
        cap = self.cap(k)
        return "uncapped" if cap is None else f"{cap:g} GB"


def _trial_scenario(scenario: Scenario, label: str, cap: float | None) -> Scenario:
    trial = copy.deepcopy(scenario)
    entry = copy.deepcopy(scenario.entry(label))
    eff = scenario.effective(entry)
    entry.device_mem_gb, entry.uncapped = None, cap is None
    trial.systems = [entry]
    trial.device_mem_gb = cap
    trial.timeline = False
    if trial.loss_after and trial.loss_after > eff["warmup"] + eff["steps"]:
        trial.loss_after = None  # a search trial runs warmup + steps steps, no more
    trial.validate()
    return trial


def _summary(cap: float | None, row: dict[str, Any], reused: bool) -> dict[str, Any]:
    out = {"device_mem_gb": cap, "status": row["status"], "step_s": row.get("step_s"),
           "peak_device_gb": row.get("peak_device_gb"), "peak_device_reserved_gb": row.get("peak_device_reserved_gb"),
           "peak_host_gb": row.get("peak_host_gb")}
    if reused:
        out["reused"] = True
    if row["status"] != "ok":
        out["reason"] = (row.get("reason") or "")[:300]
    return out


def min_cap_for_system(scenario: Scenario, label: str, out_dir: Path | None = None, *, device_gb: float | None = None,
                       spawn: bool = True, on_trial: Callable[[dict[str, Any]], None] | None = None,
                       journal: TrialJournal | None = None) -> dict[str, Any]:
    """Search the smallest device cap under which system ``label`` of ``scenario`` trains; return its row.

    Args:
        device_gb: the device's memory in GB, which an uncapped top (``min_cap.hi`` None) stands for.
        spawn: run each trial in a fresh worker process (what ``xpu bench`` does); False runs
            them in this process (fast tests on the cpu backend).
        on_trial: called with each trial's summary as it finishes.
        journal: finished trials to reuse and to add to (None: every trial runs).
    """
    mc = scenario.min_cap
    grid = CapGrid(mc.lo, mc.hi, mc.resolution, device_gb)
    entry = scenario.entry(label)
    spec = get_system(entry.name)
    base = {"system": label, "system_name": entry.name, "approximate": spec.approximate, "options": entry.options,
            "cap_range": [mc.lo, mc.hi], "cap_resolution": mc.resolution, "min_cap_gb": None, "failed_below": None,
            "trials": []}
    missing = missing_requirement(spec)
    if missing:
        return {**base, "status": "missing", "reason": missing}
    rows: dict[int, dict[str, Any]] = {}
    stop: dict[str, Any] = {}

    def passes(k: int) -> bool:
        if stop:
            return False
        cap = grid.cap(k)
        row, reused = run_trial(_trial_scenario(scenario, label, cap), label, out_dir, spawn=spawn, journal=journal,
                                log_name=f"mincap-{label}-{'uncapped' if cap is None else f'{cap:g}gb'}")
        rows[k] = row
        summary = _summary(cap, row, reused)
        base["trials"].append(summary)
        if on_trial:
            on_trial(summary)
        if row["status"] == "missing":
            stop.update(status="missing", reason=row.get("reason"))
        elif row["status"] == "ok" and row.get("peak_device_gb") is None:
            # The backend cannot see this system's device memory (e.g. FSDP2 on the cpu backend),
            # so no cap binds it either: there is no smallest cap to find.
            stop.update(status="error", reason=f"{label}'s device memory is not tracked on this backend (a cap does not "
                                               f"bind it; notes: {row.get('notes') or '-'}): no smallest cap to find")
        return row["status"] == "ok" and not stop

    def guess() -> int | None:
        top = rows[grid.top]
        peaks = [p for p in (top.get("peak_device_gb"), top.get("setup_peak_device_gb")) if p is not None]
        return grid.at_or_above(max(peaks)) if peaks else None  # setup has to fit the cap too

    best = search_smallest(passes, 0, grid.top, lo_fails=grid.lo_fails, guess=guess)
    if stop:
        return {**base, "status": stop["status"], "reason": stop["reason"]}
    if best is None:
        top = rows[grid.top]
        return {**base, "status": top["status"] if top["status"] == "oom" else "error",
                "reason": f"does not train even {'uncapped' if grid.cap(grid.top) is None else 'at ' + grid.text(grid.top)}: "
                          f"{top.get('reason') or ''}"}
    below = max((k for k, r in rows.items() if k < best and r["status"] != "ok"), default=None)
    failed = None if below is None else {"device_mem_gb": grid.cap(below), "status": rows[below]["status"],
                                         "reason": (rows[below].get("reason") or "")[:500]}
    if failed is not None:
        where = f"{grid.text(below)}: {failed['status']}"
        if best - below > 1:  # a failure further down (only after a cap-dependent system's surprise)
            where += ", caps between not tried"
    elif best == 0:
        where = "the bottom of the range searched; lower min_cap.lo to look further"
    else:  # index 0 is a cap of 0, never tried
        where = "0 GB, not tried"
    cap = grid.cap(best)
    found = "uncapped" if cap is None else f"{cap:g} GB"
    head = f"smallest cap {found} at {grid.resolution:g} GB resolution (below: {where})"
    row = rows[best]
    return {**row, **base, "min_cap_gb": grid.top_gb if cap is None else cap, "failed_below": failed,
            "notes": f"{head}; {row.get('notes') or ''}".rstrip("; ")}


def run_min_cap(scenario: Scenario | str | Path | dict[str, Any], out_dir: str | Path | None = None, *,
                systems: list[str] | None = None, progress: bool = True, command: str | None = None,
                spawn: bool = True) -> dict[str, Any]:
    """Run the smallest-cap search for every system of ``scenario``; write ``min_cap.json``/``.md``.

    Returns the result dict: ``{"machine", "date", "command", "scenario", "rows": [...]}``, each
    row the passing trial's at ``min_cap_gb`` with ``failed_below`` and its ``trials``.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    if systems:
        scenario = scenario.select(systems)

    def one(label: str, out: Path, *, info: dict[str, Any], **kw: Any) -> dict[str, Any]:
        devices = info.get("devices") or []
        device_gb = devices[0]["total_gb"] if devices else None
        return min_cap_for_system(scenario, label, out, device_gb=device_gb, spawn=spawn, **kw)

    def row_text(r: dict[str, Any]) -> str:
        return r["status"] + (f" smallest cap {r['min_cap_gb']:g} GB" if r.get("min_cap_gb") else "")

    return run_searches(scenario, out_dir, stem="min_cap", title="smallest device cap per system", spawn=spawn,
                        progress=progress, command=command or f"run_min_cap({scenario.name!r})", search_one=one,
                        trial_text=lambda t: f"cap {t['device_mem_gb'] or 'none'} {t['status']}", row_text=row_text)
