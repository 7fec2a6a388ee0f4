"""Every host-bound MemFerry row without accumulation under bench/results whose log has a clocked
rehearsal (sessions 34-43): what its rehearsal's clocked steps ran beyond their host work (the
least of the two, ``host_calibration.step_gap``), what its timed steps did, and its prediction's
error as logged and with the rehearsal's gap priced (``host_calibration.with_gap``: the step
predicted as before where the model priced at least that gap, else that much longer). Then the
same for the rows with gradient accumulation (any bound: their plans were all bound by the host
optimizer's term), from their first timed rehearsal, the plan the host check priced (later ones
are the rivals a race timed). Run from the repository root. The model's priced gap is read back
from the row: predicted step less the host work priced (the planned rate times the
host-updated parameters)."""
import glob
import json
import re
import statistics as st

CLOCK = re.compile(r"rehearsal clock \d+: steps of ([\d.]+), ([\d.]+) ms; .*?whose work took ([\d.]+), ([\d.]+) ms")
errors = {"logged": [], "gap priced": []}
close = 0
accumulating = []
for log in sorted(glob.glob("bench/results/2026-12-0[5-6]*/**/logs/*.log", recursive=True)):
    text = open(log, errors="replace").read()
    clocks, row = CLOCK.findall(text), re.search(r"@@row (\{.*\})", text)
    if not clocks or not row or "clip" in log:
        continue
    r = json.loads(row.group(1))
    if r.get("accumulation_steps", 1) != 1 or "host_work_ms_steps" not in r or not r.get("predicted_step_s"):
        if r.get("accumulation_steps", 1) > 1 and "host_work_ms_steps" in r and r.get("predicted_step_s"):
            accumulating.append((log, r, clocks[0]))
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

print("\nwith accumulation, from the first timed rehearsal:")
acc = {"logged": [], "gap priced": []}
for log, r, clock in accumulating:
    w = r.get("warmup", 2)
    steps, work = r["step_times_s"][w:], r["host_work_ms_steps"][w:]
    if not work or not r.get("host_ns_per_param"):
        continue
    measured, host = st.mean(steps) * 1e3, st.mean(work)
    predicted = r["predicted_step_s"] * 1e3
    priced_gap = predicted - r["host_planned_ns_per_param"] * host / r["host_ns_per_param"]
    a_step, b_step, a_work, b_work = map(float, clock)
    rehearsed_gap = min(a_step - a_work, b_step - b_work)
    gapped = predicted + max(0.0, rehearsed_gap - priced_gap)
    acc["logged"].append((predicted - measured) / measured)
    acc["gap priced"].append((gapped - measured) / measured)
    print(f"{log.split('results/')[1][:58]:58s} acc{r['accumulation_steps']} gap priced {priced_gap:6.1f} rehearsed "
          f"{rehearsed_gap:6.1f} steps {measured - host:6.1f} ms | error {(predicted - measured) / measured:+7.1%} -> "
          f"{(gapped - measured) / measured:+7.1%}")
for name, errs in acc.items():
    print(f"{name:10s}: mean error {st.mean(errs):+.1%}, mean |error| {st.mean(map(abs, errs)):.1%}, "
          f"within 10 %: {sum(abs(e) <= 0.10 for e in errs)}/{len(errs)}")
