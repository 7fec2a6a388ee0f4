"""Diagnostic: a device run's own MemFerry plan priced again with recomputation and backward scaled.

    python3 bench/scripts/replay_logged.py RESULTS_DIR/logs/memferry-auto.log [...] [--recompute 0.85] [--backward 0.9]

Runs on any machine (no device). For each bench row's MemFerry log (its plan lines and its
``memferry profile:`` line; the run's ``results.json`` and ``xpu-probe.json`` beside ``logs/``,
or in a sibling folder of the same call), prices the plan the row ran on its profile as logged,
then on the profile with each block's recomputation at ``--recompute`` x its forward
(``BlockProfile.recompute_s``) and every backward, the ``rest`` unit's included, at
``--backward`` x as logged: what the profiler's issued-ahead timings (session 20) would have
predicted for runs profiled before them. Prints one row per log: measured median step, both
predictions and their errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from replay_plan import PREFIX, _ProbedDevice  # noqa: E402
from strategies.memferry.config import Plan, UnitPlan  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.links import links_from_probe  # noqa: E402
from strategies.memferry.profiler import StepProfile  # noqa: E402

UNIT = re.compile(r"^\s*\d+: forward=(\S+)\s+backward=(\S+)\s+activations=(\S+)\s+optimizer=(\S+)( accumulate=device)?",
                  re.M)


def logged_plan(text: str) -> Plan:
    """The plan a MemFerry log printed (``Plan.describe`` lines, prefetch depth and rest's optimizer)."""
    units = [UnitPlan(f, b, a in ("recompute", "selective"), o, a == "offload", "device" if acc else "host",
                      a == "selective") for f, b, a, o, acc in UNIT.findall(text)]
    found = re.search(r"prefetch depth (\d+), rest optimizer on the (\w+)", text)
    if not units or found is None:
        raise ValueError("no plan lines (or no 'predicted:' line) in the log")
    return Plan(units, int(found.group(1)), found.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--recompute", type=float, default=0.85, help="recomputation over the logged forward")
    ap.add_argument("--backward", type=float, default=0.9, help="backward over the logged backward")
    args = ap.parse_args()
    print("| run | measured s | predicted as logged | error | with the factors | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for log in args.logs:
        run = log.rsplit("/logs/", 1)[0]
        probes = [os.path.join(run, "xpu-probe.json")] + sorted(glob.glob(os.path.join(os.path.dirname(run), "*",
                                                                                        "xpu-probe.json")))
        name = os.path.basename(log)[:-4]
        found = [p for p in probes if os.path.exists(p)]
        if not found:
            print(f"| {run} {name} | no xpu-probe.json beside it or in a sibling folder: not priced | | | | |")
            continue
        probe = json.load(open(found[0]))
        row = next(r for r in json.load(open(os.path.join(run, "results.json")))["rows"] if r["system"] == name)
        text = open(log).read()
        profile = StepProfile.from_json(next(ln for ln in text.splitlines() if ln.startswith(PREFIX))[len(PREFIX):])
        plan = logged_plan(text)
        margin = row.get("options", {}).get("memory_margin", 0.05)
        links = links_from_probe(_ProbedDevice(), 0, probe=probe)
        blocks = [dataclasses.replace(b, recompute_s=b.fwd_s * args.recompute, bwd_s=b.bwd_s * args.backward)
                  for b in profile.blocks]
        scaled = dataclasses.replace(profile, blocks=blocks, rest_bwd_s=profile.rest_bwd_s * args.backward)
        measured = row["step_s"]
        cells = []
        for prof in (profile, scaled):
            step = predict(plan, prof, links, margin).step_s
            cells += [f"{step:.4f}", f"{(step - measured) / measured * 100:+.1f} %"]
        print(f"| {run} {name} | {measured:.4f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
