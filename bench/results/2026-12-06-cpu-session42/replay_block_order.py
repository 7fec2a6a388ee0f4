"""Replay: the accumulation-8 row's trained plan priced as logged, with its device-updated blocks
moved first and its host-updated ones last, and the other way round (each position keeps its
activation choice). Usage: python3 replay_block_order.py LOG PROBE"""
import dataclasses
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "scripts")]

from replay_plan import logged_plan, logged_profile  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402

log, probe = sys.argv[1], sys.argv[2]
prof, links, plan = logged_profile(log), probed_links(json.load(open(probe))), logged_plan(log)
acts = [(u.recompute, u.selective, u.offload) for u in plan.units]
dev = [u for u in plan.units if u.optimizer == "device"]
host = [u for u in plan.units if u.optimizer == "host"]
for label, order in (("logged", plan.units), ("dev-first", dev + host), ("host-first", host + dev)):
    units = [dataclasses.replace(u, recompute=rc, selective=sel, offload=off) for (rc, sel, off), u in zip(acts, order)]
    p = predict(dataclasses.replace(plan, units=units), prof, links, 0.05)
    print(f"{label:12s} step {p.step_s * 1e3:.1f} compute {p.compute_s * 1e3:.1f} host {p.host_optimizer_s * 1e3:.1f} "
          f"peak {p.peak_bytes / 1e9:.2f}")
