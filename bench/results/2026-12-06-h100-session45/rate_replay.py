"""How well each reading of a rehearsal's host rate would have predicted the timed steps, over
every host-bound MemFerry row without accumulation whose log has the host-rate check (sessions
34-45). Run from the repository root.

A row's prediction is moved by its host work times the change of the rate taken (the layout
kept), as ``../2026-12-06-h100-session44/ceiling_replay.py`` does; rows whose prediction already
took the ceiling (a ``host ceiling:`` note) are moved from what they took. The rehearsal's two
clocked steps' host work (h1, h2: its second and third steps) scales the reading for the
estimators that use them (the reading itself is the third step's updates). "settled": the host
kernel alone within 1.08x of its profiled rate before and after the clocked steps.
"""
import glob
import json
import re
import statistics as st

RATE = re.compile(r"host rate: the rehearsal's host work ran at ([\d.]+) ns/param, ([\d.]+)x the ([\d.]+) the plan assumed")
PAIR = re.compile(r"host kernel alone ran ([\d.]+)x/([\d.]+)x(?:; ([\d.]+)x/([\d.]+)x)?(?:; ([\d.]+)x/([\d.]+)x)? its profiled rate")
CEIL = re.compile(r"host ceiling: the rehearsal's updates read ([\d.]+)x their price")
CLOCK = re.compile(r"rehearsal clock \d+: steps of [\d.]+, [\d.]+ ms; the training thread waited [\d., ]+ ms of them "
                   r"for the host optimizer, whose work took ([\d.]+), ([\d.]+) ms")
rows = []
for log in sorted(glob.glob("bench/results/2026-12-0[5-6]*/**/logs/*.log", recursive=True)):
    text = open(log, errors="replace").read()
    rates, row, clocks = RATE.findall(text), re.search(r"@@row (\{.*\})", text), CLOCK.findall(text)
    if not rates or not row or not clocks or "clip" in log:
        continue
    r = json.loads(row.group(1))
    if r.get("accumulation_steps", 1) != 1 or not r.get("host_work_ms_steps") or not r.get("predicted_step_s"):
        continue
    w = r.get("warmup", 2)
    measured, host = st.mean(r["step_times_s"][w:]) * 1e3, st.mean(r["host_work_ms_steps"][w:])
    if host / measured < 0.8 or not r.get("host_ns_per_param"):
        continue
    taken, _, price = map(float, rates[-1])
    ceiling = CEIL.findall(text)
    read = float(ceiling[-1]) * price if ceiling else taken
    pairs = PAIR.findall(text)
    alone = [float(v) for v in pairs[-1] if v] if pairs else []
    rows.append(dict(name=log.split("results/")[1], read=read / price, taken=taken / price,
                     steps=r["host_ns_per_param"] / price, P=r["predicted_step_s"] * 1e3, M=measured,
                     W=host * taken / r["host_ns_per_param"], settled=bool(alone) and max(alone[-2:]) <= 1.08,
                     h1=float(clocks[-1][0]), h2=float(clocks[-1][1])))


def score(label, rate):
    errors = [(x["P"] + x["W"] * (rate(x) - x["taken"]) / x["taken"] - x["M"]) / x["M"] for x in rows]
    print(f"{label:52s} within 10 %: {sum(abs(e) <= 0.10 for e in errors):2d}/{len(errors)}, mean |error| "
          f"{st.mean(map(abs, errors)):.1%}, worst {max(errors, key=abs):+.1%}")


def capped(c):
    return lambda x, read=None: min(read if read is not None else x["read"], c) if x["settled"] else (read or x["read"])


print(f"{len(rows)} rows")
score("as read (no ceiling)", lambda x: x["read"])
score("ceiling 1.25 where settled (the code since session 44)", capped(1.25))
score("ceiling 1.25 always", lambda x: min(x["read"], 1.25))
score("both clocked steps (read x mean(h1, h2) / h2), ceiling", lambda x: capped(1.25)(x, x["read"] * (x["h1"] + x["h2"]) / 2 / x["h2"]))
score("the first clocked step alone (read x h1 / h2), ceiling", lambda x: capped(1.25)(x, x["read"] * x["h1"] / x["h2"]))
score("oracle: the timed steps' own rate", lambda x: x["steps"])
