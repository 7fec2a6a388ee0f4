"""Outputs of a benchmark run: JSON, a markdown table, a plot, and per-system timelines.

Files written under the run's folder (``bench/results/<date>-<machine>/`` by default):

* ``results.json``: ``{"machine", "date", "command", "scenario", "rows": [...]}`` plus the
  machine details and software versions (``max_model.json`` for ``--max-model``,
  ``min_cap.json`` for ``--min-cap``);
* ``results.md``: the side-by-side table (``max_model.md``, ``min_cap.md``);
* ``results.png``: step time and peak memory per system (needs matplotlib; skipped with a
  note otherwise);
* ``timelines/<system>.json``: one step as Chrome-trace JSON that Perfetto and
  chrome://tracing open, in lanes: device compute, host→device, device→host,
  device→device, CPU optimizer, and the step's phases;
* ``logs/<system>.log``: each worker's own output.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from xpu.gc_clock import PAUSE_S

__all__ = ["timeline_lanes", "markdown_table", "max_model_markdown", "min_cap_markdown", "write_plot", "write_outputs", "lane_busy_ms",
           "merge_results"]

_OPTIMIZER_OP = re.compile(r"adam|optimizer", re.IGNORECASE)

# (pid, tid) of each lane, and its name
_LANES = {
    "compute": (0, 0, "compute"),
    "h2d": (0, 1, "host→device"),
    "d2h": (0, 2, "device→host"),
    "d2d": (0, 3, "device→device"),
    "device_phases": (0, 4, "step phases (device)"),
    "cpu_optimizer": (1, 0, "CPU optimizer"),
    "cpu_optimizer_ops": (1, 1, "CPU optimizer ops"),
    "phases": (1, 2, "step phases (host)"),
}
_PROCESSES = {0: "device", 1: "host"}


def _memcpy_lane(name: str) -> str | None:
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    if "DtoD" in name or "PtoP" in name:
        return "d2d"
    return None


def timeline_lanes(raw: dict[str, Any], label: str = "", optimizer_on_host: bool = False) -> dict[str, Any]:
    """Turn a ``torch.profiler`` Chrome trace into the lanes view of one step.

    Device kernels and memsets go to "compute", memcpys to the lane of their direction;
    the worker's ``bench:<phase>`` markers go to the phase lanes; when the system runs its
    optimizer on the host, its ``bench:optimizer`` span goes to "CPU optimizer" too, as do
    spans a strategy names ``optimizer:host ...`` (MemFerry's per-block host updates), and
    host ops whose names mention Adam or an optimizer to "CPU optimizer ops". On a backend
    with no device trace (the cpu reference) the forward and backward phases stand in for
    compute. Times are in microseconds from the first event.
    """
    events = [e for e in raw.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    out: list[dict[str, Any]] = []

    def add(lane: str, e: dict[str, Any]) -> None:
        pid, tid, _ = _LANES[lane]
        out.append({"ph": "X", "name": e.get("name", "?"), "cat": lane, "pid": pid, "tid": tid,
                    "ts": float(e["ts"]), "dur": float(e.get("dur", 0))})

    has_device = False
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in ("kernel", "gpu_memset"):
            add("compute", e)
            has_device = True
        elif cat == "gpu_memcpy":
            lane = _memcpy_lane(name)
            if lane:
                add(lane, e)
            has_device = True
        elif cat == "gpu_user_annotation" and name.startswith("bench:"):
            add("device_phases", e)
        elif cat == "user_annotation" and name.startswith("bench:"):
            add("phases", e)
            if name == "bench:optimizer" and optimizer_on_host:
                add("cpu_optimizer", e)
        elif cat == "user_annotation" and name.startswith("optimizer:host"):
            add("cpu_optimizer", e)  # a strategy's own span around one host update (any thread)
        elif cat == "cpu_op" and optimizer_on_host and _OPTIMIZER_OP.search(name):
            add("cpu_optimizer_ops", e)
    if not has_device:
        for e in events:
            name = e.get("name", "")
            if e.get("cat") == "user_annotation" and (name in ("bench:forward", "bench:backward")
                                                       or (name == "bench:optimizer" and not optimizer_on_host)):
                add("compute", e)
    t0 = min((e["ts"] for e in out), default=0.0)
    for e in out:
        e["ts"] = round(e["ts"] - t0, 3)
    meta: list[dict[str, Any]] = []
    for pid, pname in _PROCESSES.items():
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{label} {pname}".strip()}})
    for _, (pid, tid, tname) in _LANES.items():
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": tname}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    trace = {"traceEvents": meta + sorted(out, key=lambda e: (e["pid"], e["tid"], e["ts"])),
             "displayTimeUnit": "ms",
             "otherData": {"system": label, "device_trace": has_device,
                           "note": "one training step; lanes derived from torch.profiler events"}}
    trace["otherData"]["busy_ms"] = lane_busy_ms(trace)
    return trace


def lane_busy_ms(trace: dict[str, Any]) -> dict[str, float]:
    """Per lane, the time (ms) covered by at least one event (overlaps counted once)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X":
            spans.setdefault(e["cat"], []).append((e["ts"], e["ts"] + e["dur"]))
    busy = {}
    for lane, items in spans.items():
        items.sort()
        total, cur_s, cur_e = 0.0, None, None
        for s, t in items:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
        if cur_e is not None:
            total += cur_e - cur_s
        busy[lane] = round(total / 1e3, 3)
    return busy


# ---------------------------------------------------------------------------------- tables
def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _gb(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _count(n: Any) -> str:
    if not n:
        return "–"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


def _short(text: str | None, n: int = 90) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[-1] if "Traceback" in text else text.strip().splitlines()[0]
    line = line.replace("|", "\\|")
    return line if len(line) <= n else line[: n - 1] + "…"


def _scenario_line(result: dict[str, Any], caps: bool = True) -> str:
    sc = result["scenario"]
    dims = ", ".join(f"{k} {v}" for k, v in sc["model"].items() if k != "family" and not isinstance(v, dict))
    cap = f"{sc['device_mem_gb']} GB" if sc.get("device_mem_gb") else "none"
    host = f"{sc['host_mem_gb']} GB" if sc.get("host_mem_gb") else "none"
    params = next((r.get("params") for r in result["rows"] if r.get("params")), None)
    p = f", {_count(params)} params" if params else ""
    acc = sc.get("accumulation_steps") or 1
    batch = f"batch {sc['batch']} × seq {sc['seq']}" + (f" × {acc} accumulated micro-batches per step" if acc > 1 else "")
    return (f"model {sc['model']['family']} ({dims}{p}); {batch}; dtype {sc['dtype']}; "
            + (f"device cap {cap}; " if caps else "") + f"host cap {host}")


def _cap_note(row: dict[str, Any], scenario: dict[str, Any]) -> str:
    """``"cap 18 GB; "`` or ``"uncapped; "`` where a row ran under another device cap than the
    scenario's (an entry's own cap); "" otherwise, and for smallest-cap rows (their notes say it)."""
    cap = row.get("device_mem_gb")
    if "min_cap_gb" in row or "device_mem_gb" not in row or cap == scenario.get("device_mem_gb"):
        return ""
    return "uncapped; " if cap is None else f"cap {cap:g} GB; "


def _gc_note(row: dict[str, Any]) -> str:
    """``"full GC 271 ms in 2 of 10 timed steps; "`` where Python's full garbage collections
    paused the row's timed steps (``xpu/gc_clock.py``); "" where none did."""
    w = row.get("warmup") or 0
    timed = (row.get("gc_full_ms_steps") or [])[w:w + (row.get("steps") or 0)]
    paused = [ms for ms in timed if ms >= PAUSE_S * 1e3]
    return f"full GC {sum(paused):.0f} ms in {len(paused)} of {len(timed)} timed steps; " if paused else ""


def _merged_note(result: dict[str, Any]) -> str:
    """After the command of a merged report: that it is the first file's, and which files merged."""
    files = result.get("merged_from")
    if not files:
        return ""
    return f" (the first file's; merged by `xpu bench --merge` from {', '.join(f'`{f}`' for f in files)})"


#: How far an exact system's loss may sit from the reference before its row is flagged:
#: relative, plus an absolute floor for losses near zero. Exact systems differ by summation
#: order and precision (bf16 against mixed precision moved losses by about 10 % at step 9 of
#: docs/design.md §3); a broken set-up misses by far more (a tied-embedding Llama under ZeRO-3 read
#: 207 where every exact system read 0.01).
LOSS_TOLERANCE = (0.25, 0.05)


def flag_loss_outliers(rows: list[dict[str, Any]]) -> None:
    """Set ``loss_flag`` on each exact system's row whose loss departs from the reference's.

    The reference is the ``torch`` row (plain PyTorch) where one reports a loss, else the median
    of the exact rows when there are at least three; rows of approximate systems are never
    flagged, and only losses at the same step of the same training problem are compared (a row
    training a LoRA adapter, option ``lora``, only beside rows with the same adapter: its loss
    falls more slowly than full fine-tuning's by design). A flagged row keeps its status: it ran,
    but its set-up deserves a look before its speed is compared.
    """
    exact = [r for r in rows if r.get("status") == "ok" and r.get("loss") is not None and not r.get("approximate")]
    for r in rows:
        r.pop("loss_flag", None)
    by_step: dict[Any, list[dict[str, Any]]] = {}
    for r in exact:
        lora = (r.get("options") or {}).get("lora")
        by_step.setdefault((r.get("loss_step"), repr(lora) if lora else None), []).append(r)
    for group in by_step.values():
        torch_rows = [r for r in group if r.get("system_name", r["system"]) == "torch"]
        if torch_rows:
            ref, source = float(torch_rows[0]["loss"]), torch_rows[0]["system"]
        elif len(group) >= 3:
            ref, source = float(statistics.median(float(r["loss"]) for r in group)), "the exact systems' median"
        else:
            continue
        rel, floor = LOSS_TOLERANCE
        for r in group:
            if abs(float(r["loss"]) - ref) > rel * abs(ref) + floor:
                r["loss_flag"] = (f"loss {float(r['loss']):.3f} departs from {ref:.3f} ({source}) at step "
                                  f"{r.get('loss_step')}: check this system's set-up before comparing its speed")


def markdown_table(result: dict[str, Any]) -> str:
    """The side-by-side table of a run, with a header naming scenario, machine, date and command."""
    sc = result["scenario"]
    lines = [
        f"# {sc['name']}: {result['machine']} ({result['date']})",
        "",
        f"{_scenario_line(result)}.",
        "Step times: median over the timed steps after warm-up (device sync around each step); mean beside it. "
        "Peak device memory: over the steps, warm-up included (setup's own peak is in results.json: "
        "setup_peak_device_gb, setup_peak_device_reserved_gb).",
        "",
        f"Command: `{result['command']}`" + _merged_note(result),
        "",
        "| system | status | params | step median (s) | step mean (s) | tokens/s | TFLOP/s | peak device (GB) "
        "| peak host (GB) | loss @ step | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        status = r["status"] if r["status"] != "oom" else "OOM"
        notes = r.get("notes") or ""
        if r["status"] != "ok":
            notes = _short(r.get("reason"))
        notes = (_cap_note(r, sc) + _gc_note(r) + notes).rstrip("; ")
        if r.get("approximate"):
            notes = ("approximate (stale updates); " + notes).rstrip("; ")
        if r.get("loss_flag"):
            status, notes = "ok, loss?", (f"**{r['loss_flag']}**; " + notes).rstrip("; ")
        loss = f"{r['loss']:.3f} @ {r.get('loss_step')}" if r.get("loss") is not None else "–"
        params = _count(r.get("params"))
        lines.append(
            f"| {r['system']} | {status} | {params} | {_fmt(r.get('step_s'), '.3f')} | {_fmt(r.get('step_mean_s'), '.3f')} "
            f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('tflops'), '.3g')} | {_gb(r.get('peak_device_gb'))} "
            f"| {_gb(r.get('peak_host_gb'))} | {loss} | {notes} |")
    versions = result.get("machine_info", {}).get("versions", {})
    if versions:
        lines += ["", "Software: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)]
    if result.get("plot"):
        lines += ["", f"![step time and peak memory]({Path(result['plot']).name})"]
    elif result.get("plot_skipped"):
        lines += ["", f"({result['plot_skipped']})"]
    return "\n".join(lines) + "\n"


def max_model_markdown(result: dict[str, Any]) -> str:
    """The table of a ``--max-model`` run: the largest model per system and the trials that found it."""
    sc = result["scenario"]
    mm = sc["max_model"]
    ranges = {tuple(r.get("knob_range") or (mm["lo"], mm["hi"])) for r in result["rows"]}
    per_row = len(ranges) > 1  # merged searches over different ranges: each row says its own
    where = "each row's range with its trials" if per_row else f"in [{mm['lo']}, {mm['hi']}]"
    lines = [
        f"# {sc['name']} largest model: {result['machine']} ({result['date']})",
        "",
        f"{_scenario_line(result)}; knob {mm['knob']} {where}; "
        f"a trial trains if {mm['warmup']} + {mm['steps']} steps run without error.",
        "",
        f"Command: `{result['command']}`" + _merged_note(result),
        "",
        "| system | status | max params | configuration | step (s) | peak device (GB) | peak host (GB) | trials |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        cfg = r.get("max_config") or {}
        cfg_s = ", ".join(f"{k} {v}" for k, v in cfg.items() if k in ("layers", "hidden", "heads", "kv_heads"))
        trials = ", ".join(f"{t['value']}:{t['status']}" for t in r.get("trials", []))
        if per_row:
            lo, hi = r.get("knob_range") or (mm["lo"], mm["hi"])
            trials = f"[{lo}, {hi}] " + trials
        best = r.get("best_row") or {}
        params = _count(r.get("max_params"))
        note = "" if r["status"] == "ok" else _short(r.get("reason"), 60)
        lines.append(f"| {r['system']} | {r['status']}{' ' + note if note else ''} | {params} | {cfg_s} "
                     f"| {_fmt(best.get('step_s'), '.3f')} | {_gb(best.get('peak_device_gb'))} "
                     f"| {_gb(best.get('peak_host_gb'))} | {trials} |")
    return "\n".join(lines) + "\n"


def min_cap_markdown(result: dict[str, Any]) -> str:
    """The table of a ``--min-cap`` run: per system, its row at the smallest cap it trains under,
    the cap just below that failed, and the trials that found them."""
    sc = result["scenario"]
    mc = sc.get("min_cap") or {}
    ranges = {(tuple(r.get("cap_range") or ()), r.get("cap_resolution")) for r in result["rows"]}
    per_row = len(ranges) > 1  # merged searches over different ranges: each row says its own

    def span(lo: Any, hi: Any, res: Any) -> str:
        return f"[{lo:g}, {'uncapped' if hi is None else f'{hi:g}'}] GB at {res:g} GB"

    where = "each row's range with its trials" if per_row else span(mc.get("lo", 0), mc.get("hi"), mc.get("resolution", 1))
    lines = [
        f"# {sc['name']} smallest device cap: {result['machine']} ({result['date']})",
        "",
        f"{_scenario_line(result, caps=False)}; caps searched {where}; a trial trains if its warm-up and "
        f"timed steps run without error.",
        "",
        f"Command: `{result['command']}`" + _merged_note(result),
        "",
        "| system | status | smallest cap (GB) | failed below | step median (s) | step mean (s) | tokens/s "
        "| peak device (GB) | peak reserved (GB) | peak host (GB) | loss @ step | trials | notes |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        failed = r.get("failed_below") or {}
        below = "–" if not failed else (f"{failed['device_mem_gb']:g} GB: {failed['status']}"
                                        + (f" ({_short(failed.get('reason'), 50)})" if failed.get("reason") else ""))
        trials = ", ".join(f"{'none' if t['device_mem_gb'] is None else format(t['device_mem_gb'], 'g')}:{t['status']}"
                           for t in r.get("trials", []))
        if per_row:
            lo, hi = r.get("cap_range") or (None, None)
            trials = span(lo or 0, hi, r.get("cap_resolution") or 1) + ": " + trials
        notes = (r.get("notes") or "") if r["status"] == "ok" else _short(r.get("reason"))
        loss = f"{r['loss']:.3f} @ {r.get('loss_step')}" if r.get("loss") is not None else "–"
        lines.append(
            f"| {r['system']} | {r['status']} | {_fmt(r.get('min_cap_gb'), 'g')} | {below} "
            f"| {_fmt(r.get('step_s'), '.3f')} | {_fmt(r.get('step_mean_s'), '.3f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {_gb(r.get('peak_device_gb'))} | {_gb(r.get('peak_device_reserved_gb'))} | {_gb(r.get('peak_host_gb'))} "
            f"| {loss} | {trials} | {notes} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- plot
def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Bar charts of step time (median, mean marked) and peak device/host memory per system.

    Returns None when written, else why it was skipped (matplotlib is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib not installed"
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    if not rows:
        return "plot skipped: no system finished"
    names = [r["system"] for r in rows]
    ys = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2), sharey=True)
    ax1.barh(ys, [r["step_s"] for r in rows], color="tab:blue", label="median")
    ax1.scatter([r["step_mean_s"] for r in rows], ys, color="black", marker="|", s=200, label="mean", zorder=3)
    ax1.set_yticks(ys, names)
    ax1.invert_yaxis()
    ax1.set_xlabel("step time (s)")
    ax1.legend(loc="lower right")
    h = 0.4
    ax2.barh([y - h / 2 for y in ys], [r.get("peak_device_gb") or 0 for r in rows], height=h, label="device", color="tab:orange")
    ax2.barh([y + h / 2 for y in ys], [r.get("peak_host_gb") or 0 for r in rows], height=h, label="host", color="tab:gray")
    ax2.set_xlabel("peak memory (GB)")
    ax2.legend(loc="lower right")
    fig.suptitle(f"{result['scenario']['name']} on {result['machine']} ({result['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------- all outputs
def write_outputs(result: dict[str, Any], out_dir: Path, stem: str = "results") -> dict[str, str]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` (when possible) under ``out_dir``.

    Returns the paths written, by kind; the JSON records the plot path or why it was skipped.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {}
    if stem == "results":
        flag_loss_outliers(result["rows"])
        png = out_dir / f"{stem}.png"
        skipped = write_plot(result, png)
        if skipped:
            result["plot"], result["plot_skipped"] = None, skipped
        else:
            result["plot"], result["plot_skipped"] = png.name, None
            paths["plot"] = str(png)
        md = markdown_table(result)
    else:
        md = max_model_markdown(result) if stem == "max_model" else min_cap_markdown(result)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(md)
    paths["json"] = str(out_dir / f"{stem}.json")
    paths["markdown"] = str(out_dir / f"{stem}.md")
    return paths


def merge_results(paths: list[Path], out_dir: Path) -> dict[str, Any]:
    """Merge several ``results.json`` of one scenario into ``out_dir`` (later files win per system label).

    Timelines and logs the rows name are copied along, so the merged folder stands alone.
    ``--max-model`` results (``max_model.json``) merge the same way into ``max_model.json``/``.md``,
    each row keeping the search range it was found in, and only with their kind. ``--min-cap``
    results (``min_cap.json``) merge into ``min_cap.json``/``.md``, or, beside a ``results.json``,
    into one ``results.json``/``.md`` (each of their rows is the full row at its smallest cap).
    """
    import shutil

    merged: dict[str, Any] | None = None
    kinds: set[str] = set()
    rows: dict[str, dict[str, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in paths:
        data = json.loads(Path(path).read_text())
        merged = merged or data
        if data["scenario"].get("name") != merged["scenario"].get("name"):
            raise ValueError(f"{path}: scenario {data['scenario'].get('name')!r} differs from "
                             f"{merged['scenario'].get('name')!r}; merge results of one scenario only")
        kind = _result_kind(data["rows"])
        if kinds and (kind == "max_model") != ("max_model" in kinds):
            raise ValueError(f"{path}: a {kind}.json among {kinds.pop()}.json files; merge one kind at a time "
                             f"(min_cap.json and results.json rows do merge)")
        kinds.add(kind)
        for entry in data["scenario"].get("systems", []):
            entries[entry["label"]] = entry
        for row in data["rows"]:
            if kind == "max_model":
                mm = data["scenario"]["max_model"]
                row.setdefault("knob_range", [mm["lo"], mm["hi"]])
            rows[row["system"]] = row
            for key in ("timeline", "raw_trace", "log"):
                rel = row.get(key)
                if rel and not Path(rel).is_absolute() and (Path(path).parent / rel).exists():
                    (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    if (Path(path).parent / rel).resolve() != (out_dir / rel).resolve():
                        shutil.copy2(Path(path).parent / rel, out_dir / rel)
    assert merged is not None
    result = dict(merged)
    result["rows"] = list(rows.values())
    result["scenario"] = {**merged["scenario"], "systems": list(entries.values())}
    result["merged_from"] = [str(p) for p in paths]
    stem = "max_model" if "max_model" in kinds else "results" if "results" in kinds else "min_cap"
    result["outputs"] = write_outputs(result, out_dir, stem=stem)
    result["out_dir"] = str(out_dir)
    return result


def _result_kind(rows: list[dict[str, Any]]) -> str:
    """``max_model``, ``min_cap`` or ``results``: which search (if any) wrote these rows."""
    if any("max_params" in r for r in rows):
        return "max_model"
    return "min_cap" if rows and all("min_cap_gb" in r for r in rows) else "results"
