"""Diagnostic: MemFerry's plan search again, on a device run's own profile, with the host priced faster.

    python3 bench/scripts/replay_plan.py LOG PROBE --budget-gb 17.7 [--margin 0.05] [--host-scale 1,1.5,3]

Runs on any machine (no device). ``LOG`` is a bench row's MemFerry log (its ``memferry profile:``
line), ``PROBE`` the ``xpu-probe.json`` of the same run. For each host scale the host's rates
(the probe's triad and copy figures, the profiled AdamW) are multiplied by it and the scheduler
searches again under the budget: what would the plan be if the host were that much faster
(or, below 1, slower)? Prints one row per scale: predicted step (and, for a clipped run's
profile, the step after a clipped one), compute chain, bound, what the blocks do with their
activations and weights, and how many are updated on the device. ``--logged-plan`` prices the
plan the log trained instead of searching again (with ``--calibrate``: what a change to the host
work's price would do to that plan).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from strategies.memferry import block_costs, pareto  # noqa: E402
from strategies.memferry.cost import predict, predict_clip_fired  # noqa: E402
from strategies.memferry.host_calibration import calibrated  # noqa: E402
from strategies.memferry.config import Plan, UnitPlan  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.profiler import StepProfile  # noqa: E402
from strategies.memferry.scheduler import schedule  # noqa: E402

PREFIX = "memferry profile: "
HOST_RATES = ("triad_GBps", "copy_GBps", "triad_with_copies_GBps", "copies_GBps")


def logged_profile(path: str) -> StepProfile:
    """The profile a MemFerry bench log recorded (its ``memferry profile:`` line); exits with a
    one-line error where the log has none."""
    line = next((ln for ln in open(path) if ln.startswith(PREFIX)), None)
    if line is None:
        sys.exit(f"error: {path} has no '{PREFIX.strip()}' line; give the log of a MemFerry row with plan=auto")
    return StepProfile.from_json(line[len(PREFIX):])


_UNIT_LINE = re.compile(r"^\s*\d+: forward=(\S+)\s+backward=(\S+)\s+activations=(\S+)\s+optimizer=(\S+)"
                        r"( accumulate=device)?\s*$")
_LAYOUT = re.compile(r"prefetch depth (\d+), rest optimizer on the (host|device)")


def logged_plan(path: str) -> Plan:
    """The plan a MemFerry bench log trained (its ``Plan.describe`` lines, the first plan logged,
    with the prefetch depth and rest's optimizer from its ``predicted:`` note); exits with a
    one-line error where the log has none."""
    units: list[UnitPlan] = []
    layout = None
    for line in open(path):
        m = _UNIT_LINE.match(line)
        if m and layout is None:
            fwd, bwd, acts, opt, devacc = m.groups()
            units.append(UnitPlan(fwd, bwd, recompute=acts in ("recompute", "selective"), optimizer=opt,
                                  offload=acts == "offload", accumulate="device" if devacc else "host",
                                  selective=acts == "selective"))
        elif units and layout is None and (found := _LAYOUT.search(line)):
            layout = found
    if not units or layout is None:
        sys.exit(f"error: {path} has no logged plan ('N: forward=... optimizer=...' lines and a 'predicted:' note)")
    return Plan(units, int(layout.group(1)), layout.group(2))


def scaled(profile: StepProfile, probe: dict, scale: float) -> tuple[StepProfile, dict]:
    """``profile`` and ``probe`` with every host rate ``scale`` times faster."""
    probe = copy.deepcopy(probe)
    host = probe.get("host") or {}
    for key in HOST_RATES:
        if host.get(key):
            host[key] *= scale
    for key in ("adamw_ns_per_param", "adamw_with_copies_ns_per_param"):
        if host.get(key):
            host[key] /= scale
    faster = {f: getattr(profile, f) / scale for f in ("host_adamw_s_per_param", "host_adamw_copies_s_per_param")
              if getattr(profile, f, None)}
    return dataclasses.replace(profile, **faster), probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="a MemFerry bench log with a 'memferry profile:' line")
    ap.add_argument("probe", help="the same run's xpu-probe.json")
    ap.add_argument("--budget-gb", type=float, required=True, help="device budget of the search, GB")
    ap.add_argument("--margin", type=float, default=0.05, help="memory margin (the bench scenarios' 0.05)")
    ap.add_argument("--host-scale", default="1,1.5,3", help="host speed factors, comma-separated")
    ap.add_argument("--clip-fire-rate", type=float, default=None,
                    help="search with this share of steps clipping (AdamW.clip_fire_rate; a clipped run's profile)")
    ap.add_argument("--numpy-scan", action="store_true", help="the search's dominance scan in numpy, not C")
    ap.add_argument("--earlier-send-ms", type=float, default=None,
                    help="the issuing thread's ms per send before a step's last micro-batch (StepProfile.earlier_send_s)")
    ap.add_argument("--flat-sends", action="store_true",
                    help="search with AdamW.flat_sends (the gathered gradients in each block's backward transient)")
    ap.add_argument("--dha-view-contention", type=float, default=None,
                    help="price plain kernels over a DHA view at this factor (block_costs.DHA_VIEW_CONTENTION)")
    ap.add_argument("--split-update", action="store_true",
                    help="price host updates split in two passes (AdamW.split_update; accumulation)")
    ap.add_argument("--logged-plan", action="store_true",
                    help="price the plan the log trained at each host scale instead of searching again")
    ap.add_argument("--calibrate", default=None, metavar="UPDATE[,EARLIER]",
                    help="also price each plan on the profile calibrated to a rehearsal's host ratios "
                         "(host_calibration.calibrated: the 'host rate:' line's updates and sums factors)")
    args = ap.parse_args()
    if args.numpy_scan:
        pareto._c_scan = lambda: None
    if args.dha_view_contention is not None:
        block_costs.DHA_VIEW_CONTENTION = args.dha_view_contention
    base = logged_profile(args.log)
    if args.clip_fire_rate is not None:
        base = dataclasses.replace(base, clip_fire_rate=args.clip_fire_rate)
    if args.earlier_send_ms is not None:
        base = dataclasses.replace(base, earlier_send_s=args.earlier_send_ms / 1e3)
    if args.flat_sends:
        base = dataclasses.replace(base, flat_sends=True)
    if args.split_update:
        base = dataclasses.replace(base, split_update=True)
    probe = json.load(open(args.probe))
    clipped = getattr(base, "clipping", False)  # then also the step after a clipped one (cost.predict_clip_fired)
    ratios = [float(r) for r in args.calibrate.split(",")] if args.calibrate else None
    print("| host scale | search (s) | predicted step (ms) | " + ("after a clipped step (ms) | " if clipped else "")
          + (f"calibrated {args.calibrate} (ms) | " if ratios else "")
          + "compute chain (ms) | bound | peak GB | activations | weights (forward) | device-updated | DHA backward only |")
    print("|---:|---:|---:|" + ("---:|" if clipped else "") + ("---:|" if ratios else "") + "---:|---|---:|---|---|---:|---:|")
    said: list[str] = []  # the clip-aware choice's notes, after the table
    for scale in (float(s) for s in args.host_scale.split(",")):
        profile, p = scaled(base, probe, scale)
        links = probed_links(p)
        t0 = time.perf_counter()
        plan = (logged_plan(args.log) if args.logged_plan else
                schedule(profile, links, args.budget_gb * 1e9, margin=args.margin, explain=False, allow_dha=True))
        took = time.perf_counter() - t0
        pr = predict(plan, profile, links, margin=args.margin)
        acts = [u.activations for u in plan.units]
        kinds = ", ".join(f"{acts.count(a)} {a}" for a in sorted(set(acts)))
        fwd = [u.forward for u in plan.units]
        weights = ", ".join(f"{fwd.count(f)} {f}" for f in sorted(set(fwd)))
        extra = f"{predict_clip_fired(plan, profile, links, margin=args.margin).step_s * 1e3:.1f} | " if clipped else ""
        said += [n for n in plan.notes if "clip_fire_rate" in n]
        if ratios:  # the same plan, priced as the rehearsal's host-rate check prices it (rehearsal.py)
            extra += f"{predict(plan, calibrated(profile, *ratios), links, margin=args.margin).step_s * 1e3:.1f} | "
        print(f"| {scale:g} | {took:.1f} | {pr.step_s * 1e3:.1f} | {extra}{pr.compute_s * 1e3:.1f} | {pr.bound} | "
              f"{pr.peak_bytes / 1e9:.2f} | {kinds} | {weights} | "
              f"{sum(u.optimizer == 'device' for u in plan.units)} | "
              f"{sum(u.backward == 'dha' and u.forward != 'dha' for u in plan.units)} |", flush=True)
    for note in said:
        print(note)


if __name__ == "__main__":
    main()
