"""Diagnostic: how long MemFerry's plan search takes, and what clipping costs in the plan.

    python3 bench/scripts/diag_plan_search.py [--caps 24,16,12,8]
    python3 bench/scripts/diag_plan_search.py --log LOG --probe PROBE --caps 16 [--margin 0.05]

Runs on any machine (no device): the scheduler on the docs/design.md §3 GPT profile the tests
reconstruct from H200 measurements (``tests/test_memferry_scheduler.h200_profile``, 24 blocks),
under each cap, without and with the host-memory model (session 11's lease: triad 88.2 GB/s,
host AdamW 0.264 ns/param alone, 0.314 beside 56.3 GB/s of copies). Then the predicted step of
the 17-block model under 16 GB, unclipped and with speculative clipping. Prints a table.

With ``--log`` (a bench row's MemFerry log, its ``memferry profile:`` line) and ``--probe`` (the
same run's ``xpu-probe.json``): that profile searched under each cap as the engine searches it
(DHA allowed), without and with the per-block notes (``explain``), timed
(bench/results/2026-12-06-cpu-session38/).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from replay_plan import logged_profile  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.scheduler import schedule  # noqa: E402
from tests.test_memferry_scheduler import H200_LINKS, h200_profile  # noqa: E402


def host_model(profile, links):
    """The profile and links with session 11's host-memory figures."""
    return (replace(profile, host_adamw_s_per_param=0.264e-9, host_adamw_copies_s_per_param=0.314e-9,
                    host_copies_GBps=56.3, host_adamw_bytes_per_param=28),
            replace(links, host_GBps=88.2, host_copy_weight=0.3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="24,16,12,8", help="device caps in GB, comma-separated")
    ap.add_argument("--log", help="a MemFerry bench log whose logged profile to search")
    ap.add_argument("--probe", help="with --log: the same run's xpu-probe.json")
    ap.add_argument("--margin", type=float, default=0.05, help="with --log: memory margin (default 0.05)")
    args = ap.parse_args()
    if args.log:
        logged(args)
        return
    base = h200_profile()
    print("| profile | cap (GB) | search (s) | predicted step (ms) |\n|---|---:|---:|---:|")
    for label, (profile, links) in (("24 blocks", (base, H200_LINKS)),
                                    ("24 blocks, host-memory model", host_model(base, H200_LINKS))):
        for gb in (float(c) for c in args.caps.split(",")):
            t0 = time.perf_counter()
            plan = schedule(profile, links, gb * 1e9, explain=False)
            print(f"| {label} | {gb:g} | {time.perf_counter() - t0:.1f} | {plan.predicted_step_s * 1e3:.1f} |", flush=True)
    profile, links = host_model(replace(base, blocks=base.blocks[:17]), H200_LINKS)
    for clip in ("", "speculative"):
        plan = schedule(replace(profile, clipping=bool(clip), clip_mode=clip), links, 16e9, explain=False)
        print(f"| 17 blocks, host-memory model, clipping {clip or 'off'} | 16 | | {plan.predicted_step_s * 1e3:.1f} |")


def logged(args) -> None:
    """The logged profile searched under each cap, without and with the notes, timed."""
    import json

    if not args.probe:
        sys.exit("error: --log needs --probe, the same run's xpu-probe.json")
    profile = logged_profile(args.log)
    links = probed_links(json.load(open(args.probe)))
    print("| blocks | cap (GB) | notes | search (s) | predicted step (ms) |\n|---:|---:|---|---:|---:|")
    for gb in (float(c) for c in args.caps.split(",")):
        for explain in (False, True):
            t0 = time.perf_counter()
            plan = schedule(profile, links, gb * 1e9, margin=args.margin, allow_dha=True, explain=explain)
            print(f"| {len(profile.blocks)} | {gb:g} | {'yes' if explain else 'no'} | {time.perf_counter() - t0:.1f} | "
                  f"{plan.predicted_step_s * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
