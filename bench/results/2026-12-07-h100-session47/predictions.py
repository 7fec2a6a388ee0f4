"""Every MemFerry row with a predicted step committed since session 32: how many came within
10 % of the measured mean ((predicted - measured) / measured), per session, and each miss.

Run from the repository root: python bench/results/2026-12-07-h100-session47/predictions.py
"""
import collections
import glob
import json
import re

per_session = collections.defaultdict(lambda: [0, 0])
misses = []
for path in sorted(glob.glob("bench/results/*/**/results.json", recursive=True)):
    session = re.search(r"session(\d+)", path)
    if not session or int(session.group(1)) < 32:
        continue
    for r in json.load(open(path))["rows"]:
        pred, mean = r.get("predicted_step_s"), r.get("step_mean_s")
        if not (pred and mean and r.get("status") == "ok"):
            continue
        err = (pred - mean) / mean * 100
        tally = per_session[int(session.group(1))]
        tally[0] += abs(err) <= 10
        tally[1] += 1
        if abs(err) > 10:
            misses.append(f"  {err:+6.1f} %  {path}  {r['system']}")
within, total = (sum(t[i] for t in per_session.values()) for i in (0, 1))
print(f"{within} of {total} rows within 10 % since session 32")
print("per session (within/rows):", ", ".join(f"{s}: {w}/{n}" for s, (w, n) in sorted(per_session.items())))
print("misses:")
print("\n".join(misses))
