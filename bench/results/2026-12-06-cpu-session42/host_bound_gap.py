"""Every host-bound MemFerry row without accumulation under bench/results (host work >= 80 % of
the step): the step's time beyond the host's work, and the rows' prediction errors with a term of
k ms a layer added. Run from the repository root."""
import glob
import json
import statistics as st

rows = []
for f in sorted(glob.glob("bench/results/2026-12-0[5-6]*/**/results.json", recursive=True)):
    try:
        d = json.load(open(f))
    except (OSError, ValueError):
        continue
    for r in (d["rows"] if isinstance(d, dict) else d):
        if r.get("system_name") != "memferry" or "host_work_ms_steps" not in r or r.get("status") != "ok":
            continue
        if r.get("accumulation_steps", 1) != 1 or not r.get("predicted_step_s"):
            continue
        w = r.get("warmup", 2)
        steps, hw = r["step_times_s"][w:], r["host_work_ms_steps"][w:]
        if not steps or st.mean(hw) / (st.mean(steps) * 1e3) < 0.8:
            continue
        m, p, layers = st.mean(steps), r["predicted_step_s"], r["model"]["layers"]
        rows.append((m, p, layers))
        print(f"{f.split('results/')[1]:70s} {r['system']:14s} L{layers:<4d} step {m * 1e3:7.1f} host "
              f"{st.mean(hw):7.1f} beyond {m * 1e3 - st.mean(hw):6.1f} ms, predicted {p * 1e3:7.1f}")
print(f"{len(rows)} rows")
for k in (0.0, 0.3, 0.45, 0.6):
    errs = [((p + k * n * 1e-3) - m) / m * 100 for m, p, n in rows]
    print(f"k={k} ms/layer: mean error {st.mean(errs):+.1f} %, mean |error| {st.mean(map(abs, errs)):.1f} %, "
          f"within 10 %: {sum(abs(e) <= 10 for e in errs)}/{len(errs)}")
