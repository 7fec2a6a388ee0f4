"""Every host-bound MemFerry row without accumulation under bench/results whose log has a clocked
rehearsal (sessions 34-43): what its rehearsal's clocked steps ran beyond their host work (the
least of the two, ``host_calibration.step_gap``), what its timed steps did, and its prediction's
error as logged and with the rehearsal's gap priced (``host_calibration.with_gap``: the step
predicted as before where the model priced at least that gap, else that much longer). Run from
the repository root. The model's priced gap is read back from the row: predicted step less the
host work priced (the planned rate times the host-updated parameters)."""
import glob
import json
import re
import statistics as st

CLOCK = re.compile(r"rehearsal clock \d+: steps of ([\d.]+), ([\d.]+) ms; .*?whose work took ([\d.]+), ([\d.]+) ms")
errors = {"logged": [], "gap priced": []}
close = 0
for log in sorted(glob.glob("bench/results/2026-12-0[5-6]*/**/logs/*.log", recursive=True)):
    text = open(log, errors="replace").read()
    clocks, row = CLOCK.findall(text), re.search(r"@@row (\{.*\})", text)
    if not clocks or not row or "clip" in log:
        continue
    r = json.loads(row.group(1))
    if r.get("accumulation_steps", 1) != 1 or "host_work_ms_steps" not in r or not r.get("predicted_step_s"):
        continue
    w = r.get("warmup", 2)
    steps, work = r["step_times_s"][w:], r["host_work_ms_steps"][w:]
    if not work or st.mean(work) / (st.mean(steps) * 1e3) < 0.8:
        continue
    measured, host = st.mean(steps) * 1e3, st.mean(work)
    priced_work = r["host_planned_ns_per_param"] * host / r["host_ns_per_param"]
    predicted = r["predicted_step_s"] * 1e3
    priced_gap = predicted - priced_work
    a_step, b_step, a_work, b_work = map(float, clocks[-1])
    rehearsed_gap = min(a_step - a_work, b_step - b_work)
    gapped = predicted + max(0.0, rehearsed_gap - priced_gap)
    errors["logged"].append((predicted - measured) / measured)
    errors["gap priced"].append((gapped - measured) / measured)
    close += abs(rehearsed_gap - (measured - host)) <= 15
    print(f"{log.split('results/')[1][:58]:58s} L{r['model']['layers']:<4d} gap priced {priced_gap:6.1f} rehearsed "
          f"{rehearsed_gap:6.1f} steps {measured - host:6.1f} ms | error {(predicted - measured) / measured:+7.1%} -> "
          f"{(gapped - measured) / measured:+7.1%}")
n = len(errors["logged"])
print(f"{n} rows; the rehearsed gap within 15 ms of the steps' in {close}")
for name, errs in errors.items():
    print(f"{name:10s}: mean error {st.mean(errs):+.1%}, mean |error| {st.mean(map(abs, errs)):.1%}, "
          f"within 10 %: {sum(abs(e) <= 0.10 for e in errs)}/{n}")
