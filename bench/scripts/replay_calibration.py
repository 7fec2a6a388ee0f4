"""Diagnostic: a logged MemFerry plan priced with the host calibrated in two parts, from its steps.

    python3 bench/scripts/replay_calibration.py RESULTS_DIR/logs/memferry-auto.log [--search GB]

Runs on any machine (no device). Takes a bench row's MemFerry log (its plan lines and
``memferry profile:`` line; ``results.json`` and ``xpu-probe.json`` in the run's folder), undoes
a single-ratio calibration the profile carries (``host AdamW timings scaled by X``, before
session 21), prices the plan, then calibrates the profile as the rehearsal now does
(``host_calibration.ratios`` / ``calibrated``), with the row's own steps standing in for the
rehearsal: the host's ``adamw`` milliseconds per step as the update, ``upcast`` as the earlier
micro-batches' sums (the row's notes; exact for plans whose last pair the update adds, as every
accumulating plan without clipping). Prints the prediction before and after against the
measured step; ``--search GB`` also searches the calibrated profile under that budget and
prints the plan it would pick.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from replay_logged import logged_plan  # noqa: E402
from replay_plan import PREFIX  # noqa: E402
from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.host_calibration import calibrated, ratios  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.profiler import StepProfile  # noqa: E402
from strategies.memferry.scheduler import host_numel, price, schedule  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--search", type=float, default=None, help="device budget (GB) to search the calibrated profile")
    args = ap.parse_args()
    for log in args.logs:
        run = log.rsplit("/logs/", 1)[0]
        text = open(log).read()
        prof = StepProfile.from_json(next(ln for ln in text.splitlines() if ln.startswith(PREFIX))[len(PREFIX):])
        old = re.search(r"host AdamW timings scaled by ([0-9.]+)", text)
        if old:  # back to the profile as measured
            r = float(old.group(1))
            prof = dataclasses.replace(prof, host_adamw_s_per_param=prof.host_adamw_s_per_param / r,
                                       host_adamw_copies_s_per_param=prof.host_adamw_copies_s_per_param / r)
        plan = logged_plan(text)
        links = probed_links(json.load(open(os.path.join(run, "xpu-probe.json"))))
        name = os.path.basename(log)[:-4]
        row = next(r for r in json.load(open(os.path.join(run, "results.json")))["rows"] if r["system"] == name)
        ms = {k: float(v) for k, v in re.findall(r"(upcast|adamw|call) ([0-9.]+)", row["notes"])}
        before = price(plan, prof, links, row.get("options", {}).get("memory_margin", 0.05)).step_s
        numel = host_numel(plan, prof)
        update, earlier = ratios(plan, ((ms["adamw"] + ms.get("call", 0.0)) * 1e-3 / numel, ms["upcast"] * 1e-3 / numel))
        cal = calibrated(prof, update, earlier)
        after = predict(plan, cal, links, 0.05).step_s
        m = row["step_s"]
        print(f"{run} {name}: measured {m:.3f} s; predicted {before:.3f} ({(before - m) / m * 100:+.1f} %); steps' "
              f"host work over the plan's: updates {update:.2f}x, earlier sums {earlier:.2f}x; calibrated "
              f"{after:.3f} ({(after - m) / m * 100:+.1f} %)", flush=True)
        if args.search:
            best = schedule(cal, links, args.search * 1e9, margin=0.05, explain=False, allow_dha=True)
            pb = predict(best, cal, links, 0.05)
            acts = [u.activations for u in best.units]
            kinds = ", ".join(f"{acts.count(a)} {a}" for a in sorted(set(acts)))
            print(f"    searched under {args.search:g} GB: {pb.step_s:.3f} s, bound by the {pb.bound}; activations "
                  f"{kinds}; {sum(u.optimizer == 'device' for u in best.units)} blocks updated on the device",
                  flush=True)


if __name__ == "__main__":
    main()
