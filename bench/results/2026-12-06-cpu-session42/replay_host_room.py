"""Replay: the scheduler's search on a logged (calibrated) profile, with and without the host-room
rule (``host_room.py``). Usage: python3 replay_host_room.py LOG PROBE BUDGET_GB"""
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "scripts")]

from replay_plan import logged_profile  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.scheduler import schedule  # noqa: E402

log, probe, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
prof, links = logged_profile(log), probed_links(json.load(open(probe)))
for room in (True, False):
    plan = schedule(prof, links, int(budget * 1e9), len(prof.blocks), margin=0.05, host_room=room)
    p = predict(plan, prof, links, 0.05)
    acts: dict[str, int] = {}
    for u in plan.units:
        acts[u.activations] = acts.get(u.activations, 0) + 1
    print(f"host_room={room}: step {p.step_s * 1e3:.1f} compute {p.compute_s * 1e3:.1f} host "
          f"{p.host_optimizer_s * 1e3:.1f} acts {acts} device-updated {sum(u.optimizer == 'device' for u in plan.units)}")
