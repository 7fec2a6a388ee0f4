"""The freeze A/B: each row's steps, full collections, host loop figures and prediction.

Run from the repository root: python bench/results/2026-12-06-h200-session46/gc_ab.py [results.json ...]
(default: every results.json of this folder)
"""
import glob
import json
import os
import re
import statistics
import sys

for path in sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), '**', 'results.json'), recursive=True)):
    for r in json.load(open(path))["rows"]:
        w, n = r.get("warmup") or 0, r.get("steps") or 0
        times = r.get("step_times_s") or []
        gc_ms = r.get("gc_full_ms_steps") or []
        host = r.get("host_work_ms_steps") or []
        notes = r.get("notes") or ""
        call = re.search(r"call ([\d.]+)", notes)
        idle = re.search(r"idle ([\d.]+)", notes)
        pred, mean = r.get("predicted_step_s"), r.get("step_mean_s")
        err = f"{(pred - mean) / mean * 100:+.1f} %" if pred and mean else "-"
        print(f"{path}  {r['system']}: mean {mean:.3f} median {r.get('step_s'):.3f} predicted {pred} ({err}); "
              f"call {call and call.group(1)} idle {idle and idle.group(1)} ms")
        print("  steps s   ", " ".join(f"{t:.3f}" for t in times))
        print("  host ms   ", " ".join(f"{h:.0f}" for h in host))
        print("  full GC ms", " ".join(f"{g:.0f}" for g in gc_ms))
        if len(times) >= 8:
            others = [t for i, t in enumerate(times) if i not in (0, 2, 7)]
            m = statistics.median(others)
            print(f"  step 3 / others {times[2] / m:.2f}, step 8 / others {times[7] / m:.2f}")
        log = os.path.join(os.path.dirname(path), "logs", f"{r['system']}.log")
        for line in open(log) if os.path.exists(log) else []:
            if "rehearsal clock" in line or "host ceiling" in line:
                print("  log:", line.strip())
