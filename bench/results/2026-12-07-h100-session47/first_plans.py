"""Every committed 128-layer starved run (sessions 35-47): the plan it trained and its rehearsal's
peak (reserved, allocated, predicted, and where the first plan was made again, what it peaked at);
then session 47's first plan, which its log does not name, searched again from its own profile
with the host unscaled (as the first search had it). Runs on any machine (no device).

Run from the repository root: python bench/results/2026-12-07-h100-session47/first_plans.py
"""
import dataclasses
import glob
import json
import os
import re
import sys

sys.path.insert(0, "bench/scripts")
sys.path.insert(0, ".")

from replay_logged import logged_plan  # noqa: E402
from replay_plan import logged_profile  # noqa: E402
from strategies.memferry.cost import count_units, predict  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.scheduler import schedule  # noqa: E402

PEAK = re.compile(r"rehearsal: .*?peaked at ([\d.]+) GB reserved, ([\d.]+) GB allocated, budget [\d.]+ GB, "
                  r"predicted ([\d.]+) GB(?: \(after margin 5% peaked at ([\d.]+) GB)?")
for log in sorted(glob.glob("bench/results/2026-12-0[5-7]-*/call*/s128*/logs/memferry-auto.log")):
    text = open(log).read()
    found = PEAK.search(text)
    if "predicted:" not in text or not found:
        continue
    plan = logged_plan(text)
    reserved, allocated, predicted, first = found.groups()
    print(f"{log.split('results/')[1].split('/logs')[0]:42s} {count_units(plan.units)}, depth {plan.prefetch_depth}: "
          f"{reserved} reserved, {allocated} allocated, {predicted} predicted (GB)"
          + (f"; its first plan (margin 5 %) peaked at {first}" if first else ""))

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "call1", "s128a")
profile = logged_profile(os.path.join(here, "logs", "memferry-auto.log"))
plain = dataclasses.replace(profile, host_update_scale=1.0, host_earlier_scale=1.0, host_gap_s=0.0)
links = probed_links(json.load(open(os.path.join(here, "xpu-probe.json"))))
plan = schedule(plain, links, 16e9, len(profile.blocks), margin=0.05, explain=False)
pred = predict(plan, plain, links, 0.05)
print(f"session 47's first plan, searched again: {count_units(plan.units)}, depth {plan.prefetch_depth}, rest "
      f"optimizer on the {plan.rest_optimizer}; predicted peak {pred.peak_bytes / 1e9:.2f} GB (margin 5 %)")
