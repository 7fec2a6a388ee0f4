"""What the harness's searches share: monotone searches over an integer knob, and trials that
run once and are journaled so that a search cut short goes on where it stopped.

* :func:`search_largest`: the largest value that fits ("fits" true, then false as the value
  grows): doubling then bisection (``--max-model``, :mod:`bench.maxmodel`);
* :func:`search_smallest`: the smallest value that passes ("passes" false, then true as the
  value grows): from the top, a guess and its neighbour, then bisection (``--min-cap``,
  :mod:`bench.mincap`);
* :class:`TrialJournal` and :func:`run_trial`: one system's trial scenario run in a fresh worker
  (or in this process, for fast tests), its row kept in a ``.jsonl`` journal keyed by machine,
  system and the trial's whole scenario.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from .scenario import Scenario

__all__ = ["bisect_boundary", "search_largest", "search_smallest", "TrialJournal", "run_trial"]

#: Scenario keys that say how a search runs, not what a trial is: left out of a trial's key.
SEARCH_KEYS = ("max_model", "min_cap")


def bisect_boundary(ok: Callable[[int], bool], good: int, bad: int, resolution: int = 1) -> int:
    """Bisect between ``good`` (known to pass ``ok``) and ``bad`` (known or taken to fail), on either
    side of it, until they are at most ``resolution`` apart; return the last good value."""
    while abs(bad - good) > max(1, resolution):
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def search_largest(fits: Callable[[int], bool], lo: int, hi: int, resolution: int = 1) -> int | None:
    """Largest k in [lo, hi] with ``fits(k)``, assuming fits is monotone (True then False); None if not even lo.

    Doubling from ``lo`` then bisection: about 2·log2(answer/lo) calls. With ``resolution``
    r > 1 bisection stops once the first failure is at most r above the last success, so the
    answer may be up to r - 1 below the largest.
    """
    if not fits(lo):
        return None
    good, bad = lo, None
    while good < hi:
        nxt = min(max(2 * good, good + 1), hi)
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
            break
    return good if bad is None else bisect_boundary(fits, good, bad, resolution)


def search_smallest(passes: Callable[[int], bool], lo: int, hi: int, *, lo_fails: bool = False,
                    guess: Callable[[], int | None] | None = None) -> int | None:
    """Smallest k in [lo, hi] with ``passes(k)``, assuming passes is monotone (False then True); None if not even hi.

    ``hi`` is tried first. Then ``guess()`` (asked after hi passed, e.g. from the peak memory
    hi's trial measured) and its neighbour: one below if the guess passes, one above if not,
    so a good guess settles the boundary in two more calls. Then bisection between the
    closest pass and failure. ``lo`` is taken to fail until the bisection ends next to it,
    and is only then tried (never when ``lo_fails``: e.g. a cap of 0).
    """
    tried: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            tried[k] = passes(k)
        return tried[k]

    if not ok(hi):
        return None
    good, bad = hi, lo
    g = guess() if guess is not None else None
    if g is not None and lo < g < hi:
        if ok(g):
            good = g
            if lo < g - 1:
                good, bad = (g - 1, lo) if ok(g - 1) else (g, g - 1)
        else:
            bad = g
            if g + 1 < hi:
                good, bad = (g + 1, g) if ok(g + 1) else (hi, g + 1)
    good = bisect_boundary(ok, good, bad, 1)
    if good - 1 == lo and not lo_fails and ok(lo):
        return lo
    return good


class TrialJournal:
    """Finished trials of a search, one JSON line each, for reruns to reuse.

    Args:
        path: the ``.jsonl`` file (created on the first trial).
        machine: the machine the trials ran on; trials of other machines are never reused.
    """

    def __init__(self, path: Path, machine: str) -> None:
        self.path, self.machine = Path(path), machine
        self._rows: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self._rows[rec["key"]] = rec["row"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short when a call hit its time limit

    def key(self, trial: Scenario, label: str) -> str:
        """What identifies a trial: machine, system and the trial's whole scenario (caps included)."""
        scenario = {k: v for k, v in trial.to_dict().items() if k not in SEARCH_KEYS}  # how to search is not the trial
        blob = json.dumps({"machine": self.machine, "label": label, "scenario": scenario}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> dict[str, Any] | None:
        """The row of a finished trial, or None."""
        return self._rows.get(key)

    def add(self, key: str, row: dict[str, Any]) -> None:
        """Record a finished trial (appended at once, so a cut-off search keeps it)."""
        self._rows[key] = row
        with self.path.open("a") as fh:
            fh.write(json.dumps({"key": key, "row": row}, default=str) + "\n")


def run_trial(trial: Scenario, label: str, out_dir: Path | None, *, spawn: bool, journal: TrialJournal | None,
              log_name: str) -> tuple[dict[str, Any], bool]:
    """Run system ``label`` of the one-system scenario ``trial``, or take its row from ``journal``.

    Args:
        spawn: a fresh worker process (what ``xpu bench`` does); False runs it in this process
            (fast tests on the cpu backend).
        log_name: the worker log's name under ``out_dir/logs/``.

    Returns:
        ``(row, reused)``; a new row is journaled unless its system is missing.
    """
    key = journal.key(trial, label) if journal is not None else None
    row = journal.get(key) if journal is not None else None
    if row is not None:
        return row, True
    if spawn:
        from .runner import run_system

        row = run_system(trial, label, out_dir or Path("."), timeline=False, log_name=log_name)
    else:
        from .worker import run_spec

        row = run_spec({"scenario": trial.to_dict(), "label": label, "timeline_path": None}, in_process=True)
    if journal is not None and row["status"] != "missing":
        journal.add(key, row)
    return row, False


def run_searches(scenario: Scenario, out_dir: str | Path | None, *, stem: str, title: str, spawn: bool, progress: bool,
                 command: str, search_one: Callable[..., dict[str, Any]],
                 trial_text: Callable[[dict[str, Any]], str], row_text: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Run one search per system of ``scenario`` and write ``<stem>.json``/``.md`` (trials journaled in
    ``<stem>_trials.jsonl`` there, so a rerun into the same folder goes on where one stopped).

    Args:
        search_one: ``(label, out_dir, journal=, on_trial=, info=) -> row``, the search of one system
            (``info``: the machine's description, e.g. its device memory).
        trial_text, row_text: a progress line for a finished trial's summary and a system's row.
    """
    import datetime as _dt

    from .report import write_outputs
    from .runner import _progress, default_out_dir, describe_machine

    if spawn:
        info = describe_machine()
    else:
        from .worker import describe

        info = describe()
    date = _dt.date.today().isoformat()
    out = Path(out_dir) if out_dir else default_out_dir(info["machine"], date)
    out.mkdir(parents=True, exist_ok=True)
    journal = TrialJournal(out / f"{stem}_trials.jsonl", info["machine"])
    rows = []
    with _progress(progress) as bars:
        overall = bars.add_task(f"{scenario.name}: {title}", total=len(scenario.systems))
        for entry in scenario.systems:
            task = bars.add_task(f"  {entry.label}", total=None)

            def on_trial(t: dict[str, Any], task: Any = task, label: str = entry.label) -> None:
                bars.update(task, description=f"  {label}: {trial_text(t)}")

            row = search_one(entry.label, out, journal=journal, on_trial=on_trial, info=info)
            bars.update(task, total=1, completed=1, description=f"  {entry.label}: {row_text(row)}")
            bars.advance(overall)
            rows.append(row)
    result = {"machine": info["machine"], "date": date, "command": command, "scenario": scenario.to_dict(),
              "machine_info": info, "rows": rows, "finished_at": _dt.datetime.now().isoformat(timespec="seconds")}
    result["outputs"] = write_outputs(result, out, stem=stem)
    result["out_dir"] = str(out)
    return result
