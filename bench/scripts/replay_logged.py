"""Diagnostic: a device run's own MemFerry plan priced again with recomputation and backward scaled.

    python3 bench/scripts/replay_logged.py RESULTS_DIR/logs/memferry-auto.log [...] [--recompute 0.85] [--backward 0.9]
        [--stream-overhead 1.15] [--link-scale 1.0] [--host-scale 1.0]

Runs on any machine (no device). For each bench row's MemFerry log (its plan lines and its
``memferry profile:`` line; the run's ``results.json`` and ``xpu-probe.json`` beside ``logs/``,
or in a sibling folder of the same call), prices the plan the row ran on its profile as logged,
then on the profile with each block's recomputation at ``--recompute`` x its forward
(``BlockProfile.recompute_s``) and every backward, the ``rest`` unit's included, at
``--backward`` x as logged: what the profiler's issued-ahead timings (session 20) would have
predicted for runs profiled before them. ``--stream-overhead`` prices a streamed ``host_linear``
block at that multiple of its weight's link time (``block_costs.STREAM_OVERHEAD``) and
``--link-scale`` scales both link rates, in that second pricing too (``--as-logged``: with the
logged recomputation and backward times); ``--host-scale`` prices the host updates there at that
multiple of the profiled rate in place of the logged calibration (``StepProfile.host_update_scale``:
what the rehearsal measured). Prints one row per log:
measured median step (``--mean``: mean), both predictions and their errors.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import sys
from typing import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from replay_plan import PREFIX  # noqa: E402
from strategies.memferry import block_costs  # noqa: E402
from strategies.memferry.config import Plan, UnitPlan  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
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


@contextlib.contextmanager
def _stream_overhead(value: float | None) -> Iterator[None]:
    """``block_costs.STREAM_OVERHEAD`` set to ``value`` (None: as it is) for the block."""
    kept = block_costs.STREAM_OVERHEAD
    block_costs.STREAM_OVERHEAD = kept if value is None else value
    try:
        yield
    finally:
        block_costs.STREAM_OVERHEAD = kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--recompute", type=float, default=0.85, help="recomputation over the logged forward")
    ap.add_argument("--backward", type=float, default=0.9, help="backward over the logged backward")
    ap.add_argument("--stream-overhead", type=float, default=None,
                    help="a streamed host_linear block's time over its link time (block_costs.STREAM_OVERHEAD)")
    ap.add_argument("--link-scale", type=float, default=1.0, help="both link rates times this")
    ap.add_argument("--probe", default=None, help="the run's xpu-probe.json (default: beside the log's run or a sibling)")
    ap.add_argument("--host-scale", type=float, default=None,
                    help="host updates at this multiple of the profiled rate (default: the logged calibration)")
    ap.add_argument("--mean", action="store_true", help="against the mean of the timed steps (default: the median)")
    ap.add_argument("--as-logged", action="store_true",
                    help="keep the logged recomputation and backward times (ignore --recompute and --backward)")
    args = ap.parse_args()
    print("| run | measured s | predicted as logged | error | with the factors | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for log in args.logs:
        run = log.rsplit("/logs/", 1)[0]
        probes = [os.path.join(run, "xpu-probe.json")] + sorted(glob.glob(os.path.join(os.path.dirname(run), "*",
                                                                                        "xpu-probe.json")))
        name = os.path.basename(log)[:-4]
        found = [args.probe] if args.probe else [p for p in probes if os.path.exists(p)]
        if not found:
            print(f"| {run} {name} | no xpu-probe.json beside it or in a sibling folder: not priced | | | | |")
            continue
        probe = json.load(open(found[0]))
        row = next(r for r in json.load(open(os.path.join(run, "results.json")))["rows"] if r["system"] == name)
        text = open(log).read()
        profile = StepProfile.from_json(next(ln for ln in text.splitlines() if ln.startswith(PREFIX))[len(PREFIX):])
        plan = logged_plan(text)
        margin = row.get("options", {}).get("memory_margin", 0.05)
        links = probed_links(probe)
        blocks = [dataclasses.replace(b, recompute_s=b.fwd_s * args.recompute, bwd_s=b.bwd_s * args.backward)
                  for b in profile.blocks]
        scaled = profile if args.as_logged else dataclasses.replace(profile, blocks=blocks,
                                                                     rest_bwd_s=profile.rest_bwd_s * args.backward)
        if args.host_scale is not None:
            scaled = dataclasses.replace(scaled, host_update_scale=args.host_scale)
        measured = row["step_mean_s"] if args.mean else row["step_s"]
        slower = dataclasses.replace(links, h2d_GBps=links.h2d_GBps * args.link_scale,
                                     d2h_GBps=links.d2h_GBps * args.link_scale)
        cells = []
        for prof, lk, overhead in ((profile, links, None), (scaled, slower, args.stream_overhead)):
            with _stream_overhead(overhead):
                step = predict(plan, prof, lk, margin).step_s
            cells += [f"{step:.4f}", f"{(step - measured) / measured * 100:+.1f} %"]
        print(f"| {run} {name} | {measured:.4f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
