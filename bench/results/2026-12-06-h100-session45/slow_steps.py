"""Steps 3 and 8 (indices 2 and 7, warm-up counted) of the host-bound starved rows against the
median of the other steps: the cadence of Python's full garbage collections before
``freeze_setup`` (``strategies/memferry/gc_pauses.py``).

Run from the repository root: python bench/results/2026-12-06-h100-session45/slow_steps.py
"""
import glob
import json
import statistics

print(f"{'row':58s} {'step 3':>7s} {'step 8':>7s}  (step time / median of the other steps; host work likewise)")
for path in sorted(glob.glob("bench/results/2026-12-0[56]-h*-session*/**/results.json", recursive=True)):
    rows = json.load(open(path))
    for r in rows if isinstance(rows, list) else rows.get("rows", []):
        times, host = r.get("step_times_s") or [], r.get("host_work_ms_steps") or []
        if len(times) < 8 or r.get("accumulation_steps", 1) != 1 or r.get("params", 0) < 3e9:
            continue
        others = [t for i, t in enumerate(times) if i not in (0, 2, 7)]  # step 1 has no update beside it
        h_others = [h for i, h in enumerate(host) if i not in (0, 2, 7)]
        m, hm = statistics.median(others), statistics.median(h_others) if h_others else None
        hs = f"  host {host[2] / hm:.2f} {host[7] / hm:.2f}" if hm else ""
        print(f"{path[14:-13]:58s} {times[2] / m:7.2f} {times[7] / m:7.2f}{hs}")
