"""Every host-bound MemFerry row without accumulation under bench/results whose log has the
host-rate check (sessions 34-44): how far over the plan's price its rehearsal read the host's
updates and how far its timed steps ran, and its prediction's error as logged and with a settled
rehearsal's updates taken at most at a ceiling (``host_calibration.CEILING``; settled: the host
kernel alone within 1.08x of its profiled rate before and after the clocked steps). Run from the
repository root. A row's predicted host work is its measured host work at the rehearsal's rate;
a ceiling moves the prediction by that work times the rate's change (the layout kept)."""
import glob
import json
import re
import statistics as st

RATE = re.compile(r"host rate: the rehearsal's host work ran at ([\d.]+) ns/param, ([\d.]+)x the ([\d.]+) the plan assumed")
PAIR = re.compile(r"host kernel alone ran ([\d.]+)x/([\d.]+)x(?:; ([\d.]+)x/([\d.]+)x)? its profiled rate")
rows = []
for log in sorted(glob.glob("bench/results/2026-12-0[5-6]*/**/logs/*.log", recursive=True)):
    text = open(log, errors="replace").read()
    rates, row = RATE.findall(text), re.search(r"@@row (\{.*\})", text)
    if not rates or not row or "clip" in log:
        continue
    r = json.loads(row.group(1))
    if r.get("accumulation_steps", 1) != 1 or not r.get("host_work_ms_steps") or not r.get("predicted_step_s"):
        continue
    w = r.get("warmup", 2)
    steps, work = r["step_times_s"][w:], r["host_work_ms_steps"][w:]
    measured, host = st.mean(steps) * 1e3, st.mean(work)
    if host / measured < 0.8 or not r.get("host_ns_per_param"):
        continue
    read, _, price = map(float, rates[-1])
    pairs = PAIR.findall(text)
    last = pairs[-1] if pairs else None
    pair = None if last is None else (float(last[2]), float(last[3])) if last[2] else (float(last[0]), float(last[1]))
    rows.append((log.split("results/")[1], r["model"].get("layers"), read, price, r["host_ns_per_param"],
                 r["predicted_step_s"] * 1e3, measured, host * read / r["host_ns_per_param"], pair))

print(f"{len(rows)} rows; the timed steps' host rate over the plan's price: at most "
      f"{max(s / p for _, _, _, p, s, *_ in rows):.2f}x; the rehearsals': at most {max(x / p for _, _, x, p, *_ in rows):.2f}x")
for ceiling in (None, 1.2, 1.25, 1.3):
    errors, held = [], []
    for name, layers, read, price, steps_rate, predicted, measured, work, pair in rows:
        taken = read
        if ceiling and pair is not None and max(pair) <= 1.08:
            taken = min(read, ceiling * price)
        moved = predicted - work * (1 - taken / read)
        errors.append((moved - measured) / measured)
        if taken < read:
            held.append(f"  {name[:58]:58s} L{layers:<4} read {read / price:.2f}x, steps {steps_rate / price:.2f}x: "
                        f"{(predicted - measured) / measured:+.1%} -> {errors[-1]:+.1%}")
    print(f"ceiling {ceiling or 'none':>4}: mean error {st.mean(errors):+.1%}, mean |error| "
          f"{st.mean(map(abs, errors)):.1%}, within 10 %: {sum(abs(e) <= 0.10 for e in errors)}/{len(errors)}")
    if ceiling == 1.25:
        print("\n".join(held))
