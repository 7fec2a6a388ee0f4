"""Replay a MemFerry log's profile with clipping off and on: each search's plan, priced unclipped and after a clip.

    python3 bench/results/2026-12-05-h200-session33/scripts/replay_clip_on.py LOG PROBE BUDGET_GB MARGIN
"""
import dataclasses, json, sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "scripts")]
from replay_plan import PREFIX, scaled
from strategies.memferry.profiler import StepProfile
from strategies.memferry.scheduler import schedule
from strategies.memferry.cost import predict, predict_clip_fired
from strategies.memferry.links import probed_links
log, probe_path, budget, margin = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
base = StepProfile.from_json([l for l in open(log) if l.startswith(PREFIX)][0][len(PREFIX):])
probe = json.load(open(probe_path))
for clip in (False, True):
    prof, p = scaled(dataclasses.replace(base, clipping=clip), probe, 1.0)
    links = probed_links(p)
    plan = schedule(prof, links, budget * 1e9, margin=margin, explain=False, allow_dha=True)
    cprof = dataclasses.replace(prof, clipping=True)
    print(f"clipping={clip}: step {predict(plan, prof, links, margin=margin).step_s*1e3:.1f} ms; with clip on, "
          f"unfired {predict(plan, cprof, links, margin=margin).step_s*1e3:.1f}, fired {predict_clip_fired(plan, cprof, links, margin=margin).step_s*1e3:.1f}; "
          f"device sums {sum(u.accumulate == 'device' for u in plan.units)}")
