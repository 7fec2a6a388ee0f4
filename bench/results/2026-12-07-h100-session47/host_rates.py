"""Host AdamW ns/param over every starved row (scenario name with "starved", no accumulation,
status ok) committed since session 32: how many, and the least and most, with where.

Run from the repository root: python bench/results/2026-12-07-h100-session47/host_rates.py
"""
import glob
import json
import re

rows = []
for path in sorted(glob.glob("bench/results/*/**/results.json", recursive=True)):
    session = re.search(r"session(\d+)", path)
    if not session or int(session.group(1)) < 32:
        continue
    data = json.load(open(path))
    scenario = data.get("scenario")
    name = scenario.get("name") if isinstance(scenario, dict) else scenario
    for r in data["rows"]:
        rate = r.get("host_ns_per_param")
        if rate and r.get("status") == "ok" and "starved" in str(name) and (r.get("accumulation_steps") or 1) == 1:
            rows.append((rate, path, r["system"]))
rows.sort()
print(f"{len(rows)} starved rows without accumulation since session 32; host AdamW ns/param "
      f"{rows[0][0]:.3f}-{rows[-1][0]:.3f}, every one at most 0.35: {all(r[0] <= 0.35 for r in rows)}")
for rate, path, system in rows[:2] + rows[-2:]:
    print(f"  {rate:.4f}  {path}  {system}")
