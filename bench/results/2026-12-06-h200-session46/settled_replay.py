"""The 128-layer row of call 4 priced again as the rehearsal now reads its host: the settled
first rehearsal's rate, not the disturbed second one's bound (``host_calibration.least_disturbed``),
and the first one's gap (``with_gap``). Runs on any machine (no device).

Its first plan (margin 5 %) peaked at 16.6 GB in its rehearsal, which ran with the host kernel alone
settled (1.00x/1.05x); the plan made again (margin 15 %) was rehearsed with the host disturbed
three times (its last run 1.00x before, 1.15x after), so its host work was taken at the plan's
price (1.00x) and, as the least of the two, priced the steps: 1.086 s predicted, 1.376 s run.
That first plan is not logged; its host-updated blocks are at most the second's 119 (a smaller
margin leaves room for more resident blocks), so its reading is bracketed for 117-119.

Run from the repository root: python bench/results/2026-12-06-h200-session46/settled_replay.py
"""
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, "bench/scripts")
sys.path.insert(0, ".")

from replay_logged import logged_plan  # noqa: E402
from replay_plan import PREFIX  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.profiler import StepProfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
run = os.path.join(HERE, "call4", "s128")
text = open(os.path.join(run, "logs", "memferry-auto.log")).read()
profile = StepProfile.from_json(next(ln for ln in text.splitlines() if ln.startswith(PREFIX))[len(PREFIX):])
plan = logged_plan(text)
links = probed_links(json.load(open(os.path.join(HERE, "call1", "gc128", "xpu-probe.json"))))  # same lease
row = json.load(open(os.path.join(run, "results.json")))["rows"][0]
measured = row["step_mean_s"]
clocks = re.findall(r"rehearsal clock (\d): steps of ([\d.]+), ([\d.]+) ms;.*?work took ([\d.]+), ([\d.]+) ms", text)
first = [float(x) for x in clocks[0][1:]]
gap = min(first[0] - first[2], first[1] - first[3]) * 1e-3
host_blocks = sum(u.optimizer == "host" for u in plan.units)
plain = dataclasses.replace(profile, host_update_scale=1.0, host_earlier_scale=1.0, host_gap_s=0.0)
priced = predict(plan, plain, links, 0.05)
first_work = (first[2] + first[3]) / 2e3


def line(what, pred):
    print(f"{what:64s} {pred:.3f} s  ({(pred - measured) / measured * 100:+.1f} %)")


print(f"measured mean {measured:.3f} s; logged prediction {row['predicted_step_s']:.3f} s; the plan as logged "
      f"{host_blocks} host-updated blocks, host work priced {priced.host_optimizer_s * 1e3:.1f} ms")
line("as logged (the disturbed rehearsal's bound, 1.00x)", predict(plan, profile, links, 0.05).step_s)
for blocks in (host_blocks, host_blocks - 1, host_blocks - 2):
    ratio = first_work / (priced.host_optimizer_s * blocks / host_blocks)
    cal = dataclasses.replace(plain, host_update_scale=ratio)
    pred = predict(plan, cal, links, 0.05)
    with_gap = dataclasses.replace(cal, host_gap_s=max(0.0, gap - (pred.step_s - pred.host_optimizer_s)))
    line(f"first rehearsal settled, {blocks} host blocks: updates {ratio:.2f}x", pred.step_s)
    line(f"  and its gap ({gap * 1e3:.1f} ms beyond the host work)", predict(plan, with_gap, links, 0.05).step_s)
