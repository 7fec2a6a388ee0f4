"""Run a scenario's systems one after another, each in a fresh worker process, and collect rows.

A fresh process per system means each starts with an empty device and allocator, no
leftover process group, and its own memory cap; a crash, a hang (timeout) or a host OOM kill
in one system becomes that system's row and the run goes on.

Python use (the same entry as ``xpu bench``)::

    from bench import run_bench
    result = run_bench("examples/bench/tiny.yaml", out_dir="/tmp/bench")
    print(result["rows"][0]["step_s"])
"""
from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .scenario import Scenario, load_scenario
from .systems import get_system, missing_requirement
from .worker import PROGRESS_PREFIX, ROW_PREFIX

__all__ = ["run_bench", "spawn_worker", "describe_machine", "default_out_dir", "REPO_ROOT"]

#: The folder holding the ``bench`` package (put on the workers' PYTHONPATH).
REPO_ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# Process groups of the workers running now. Each worker runs in its own session (so a timeout
# can kill it with its children), which also means a signal ending this process would not
# reach it: on SIGTERM, SIGINT or SIGHUP (e.g. ``timeout`` around ``xpu bench``) and at exit
# they are killed here, or they would hold the device into whatever runs next.
_LIVE_GROUPS: set[int] = set()
_handlers_installed = False


def _kill_live_workers() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _LIVE_GROUPS.discard(pgid)


def _install_signal_handlers() -> None:
    """Kill live workers before this process ends by a signal (once; main thread only)."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            _kill_live_workers()
            if callable(previous):
                previous(signum, frame)  # e.g. Python's KeyboardInterrupt for SIGINT
            elif previous != signal.SIG_IGN:  # the default action: end as the signal would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
    atexit.register(_kill_live_workers)
    _handlers_installed = True


def spawn_worker(args: list[str], *, timeout_s: float, log_path: Path | None = None,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[int | None, str, bool]:
    """Run ``python -m bench.worker ARGS`` in its own process group.

    Returns ``(returncode, tail_of_output, timed_out)``. Worker output goes to ``log_path``;
    ``@@progress`` lines are parsed and handed to ``on_progress``. On timeout the whole
    process group is killed (DeepSpeed/ZenFlow may have started children).
    """
    cmd = [sys.executable, "-m", "bench.worker", *args]
    _install_signal_handlers()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=_env(), cwd=str(REPO_ROOT), start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    tail: list[str] = []
    log = open(log_path, "w") if log_path else None

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS_PREFIX):
                if on_progress:
                    try:
                        on_progress(json.loads(line[len(PROGRESS_PREFIX):]))
                    except (ValueError, TypeError):
                        pass
                continue
            if log:
                log.write(line)
            if not line.startswith(ROW_PREFIX):
                tail.append(line)
                del tail[:-40]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, nothing else
        except ProcessLookupError:
            pass
        proc.wait()
    finally:
        _LIVE_GROUPS.discard(proc.pid)
    reader.join(timeout=5)
    if log:
        log.close()
    return proc.returncode, "".join(tail), timed_out


def describe_machine(timeout_s: float = 300) -> dict[str, Any]:
    """Machine and software facts, gathered in a worker so this process never touches the device."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "describe.json"
        rc, tail, timed_out = spawn_worker(["--describe", "--result", str(out)], timeout_s=timeout_s)
        if out.exists():
            return json.loads(out.read_text())
    from .scenario import ScenarioError

    raise ScenarioError(f"could not describe the machine (worker exit {rc}{', timed out' if timed_out else ''}): "
                        f"{tail.strip()[-2000:]}")


def default_out_dir(machine: str, date: str | None = None) -> Path:
    """``bench/results/<date>-<machine>/``."""
    date = date or _dt.date.today().isoformat()
    return REPO_ROOT / "bench" / "results" / f"{date}-{machine}"


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def _failed_row(scenario: Scenario, label: str, status: str, reason: str) -> dict[str, Any]:
    entry = scenario.entry(label)
    eff = scenario.effective(entry)
    return {"system": label, "system_name": entry.name, "status": status, "reason": reason,
            "approximate": get_system(entry.name).approximate, "options": entry.options,
            "family": scenario.family, "model": scenario.model_dims(), "params": None,
            "batch": scenario.batch, "seq": scenario.seq, "accumulation_steps": scenario.accumulation_steps,
            "steps": eff["steps"], "warmup": eff["warmup"],
            "device_mem_gb": eff["device_mem_gb"], "host_mem_gb": scenario.host_mem_gb,
            "step_s": None, "step_mean_s": None, "tokens_per_s": None, "tflops": None,
            "peak_device_gb": None, "peak_host_gb": None, "loss": None}


def run_system(scenario: Scenario, label: str, out_dir: Path, *, timeline: bool = True, raw_trace: bool = False,
               device_mem_gb: float | None = None, extra_requires: tuple[str, ...] = (),
               on_progress: Callable[[dict[str, Any]], None] | None = None, log_name: str | None = None) -> dict[str, Any]:
    """Run one system of ``scenario`` in a fresh worker and return its row (never raises for the system's failures)."""
    entry = scenario.entry(label)
    spec_sys = get_system(entry.name)
    missing = missing_requirement(spec_sys, extra_requires)
    if missing:
        return _failed_row(scenario, label, "missing", missing)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    stem = _safe(log_name or label)
    spec = {"scenario": scenario.to_dict(), "label": label, "device_mem_gb": device_mem_gb,
            "timeline_path": str(out_dir / "timelines" / f"{stem}.json") if timeline else None,
            "raw_trace_path": str(out_dir / "timelines" / f"{stem}.raw.json.gz") if timeline and raw_trace else None}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, row_path = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec_path.write_text(json.dumps(spec))
        rc, tail, timed_out = spawn_worker(["--spec", str(spec_path), "--result", str(row_path)],
                                           timeout_s=scenario.timeout_s, log_path=out_dir / "logs" / f"{stem}.log",
                                           on_progress=on_progress)
        if row_path.exists() and not timed_out:
            row = json.loads(row_path.read_text())
        elif timed_out:
            row = _failed_row(scenario, label, "error", f"timed out after {scenario.timeout_s:g} s (see logs/{stem}.log)")
        else:
            how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exited with status {rc}"
            hint = " (SIGKILL: the host may have run out of memory)" if rc == -9 else ""
            row = _failed_row(scenario, label, "error", f"worker {how}{hint} without a result; last output:\n{tail.strip()[-1500:]}")
    row["log"] = f"logs/{stem}.log"
    # Paths relative to the run's folder: the folder is copied off the device and committed.
    for key in ("timeline", "raw_trace"):
        if row.get(key):
            row[key] = os.path.relpath(row[key], out_dir)
    return row


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled, transient=False)


def run_bench(scenario: Scenario | str | Path | dict[str, Any], out_dir: str | Path | None = None, *,
              systems: list[str] | None = None, append: bool = False, timeline: bool | None = None,
              raw_trace: bool = False, progress: bool = True, command: str | None = None) -> dict[str, Any]:
    """Run every system of ``scenario`` side by side and write the outputs.

    Args:
        scenario: a :class:`Scenario`, a YAML path, a scenario name, or a dict.
        out_dir: where to write (default ``bench/results/<date>-<machine>/``).
        systems: labels or names to run (default: all of the scenario's, in order).
        append: keep rows of an existing ``results.json`` in ``out_dir`` whose labels this
            run does not produce (to measure a scenario over several invocations).
        timeline: profile one step per system (default: the scenario's ``timeline``).
        raw_trace: also keep each raw profiler trace (gzip).
        progress: show progress bars on stderr.
        command: the command line recorded in the outputs.

    Returns:
        The result dict written to ``results.json``.
    """
    from .report import write_outputs

    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    if systems:
        scenario = scenario.select(systems)
    if timeline is not None:
        scenario.timeline = timeline
    info = describe_machine()
    date = _dt.date.today().isoformat()
    out = Path(out_dir) if out_dir else default_out_dir(info["machine"], date)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with _progress(progress) as bars:
        overall = bars.add_task(f"{scenario.name}: systems", total=len(scenario.systems))
        for entry in scenario.systems:
            eff = scenario.effective(entry)
            task = bars.add_task(f"  {entry.label}", total=eff["total_steps"])

            def on_progress(p: dict[str, Any], task=task) -> None:
                bars.update(task, completed=p.get("step", 0), total=p.get("total"))

            row = run_system(scenario, entry.label, out, timeline=scenario.timeline, raw_trace=raw_trace,
                             on_progress=on_progress)
            status = row["status"] + (f" {row['step_s']:.3f}s" if row.get("step_s") else "")
            bars.update(task, description=f"  {entry.label}: {status}", completed=eff["total_steps"])
            bars.advance(overall)
            rows.append(row)
            # Rows so far, in case the run is cut short (a device call's time limit): merge
            # them later with `xpu bench --merge`.
            (out / "results.partial.json").write_text(json.dumps({"machine": info["machine"], "date": date,
                                                                  "command": command, "rows": rows}))
    if append and (out / "results.json").exists():
        old = json.loads((out / "results.json").read_text())
        mine = {r["system"] for r in rows}
        rows = [r for r in old.get("rows", []) if r["system"] not in mine] + rows
    result = {
        "machine": info["machine"],
        "date": date,
        "command": command or f"run_bench({scenario.name!r})",
        "scenario": scenario.to_dict(),
        "machine_info": info,
        "rows": rows,
        "finished_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "timestamp": time.time(),
    }
    if append and (out / "results.json").exists():
        result["scenario"]["systems"] = _merge_entries(old["scenario"].get("systems", []), result["scenario"]["systems"])
    result["outputs"] = write_outputs(result, out)
    (out / "results.partial.json").unlink(missing_ok=True)
    result["out_dir"] = str(out)
    return result


def _merge_entries(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    labels = {e["label"] for e in new}
    return [e for e in old if e.get("label") not in labels] + new
