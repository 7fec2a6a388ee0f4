"""This session's two starved rows replayed: each plan priced on its logged (calibrated) profile and
the call's probe, then with its rehearsal's gap priced (``host_calibration.with_gap``, the least
of its last clocked rehearsal's two steps). Run from the repository root; no device."""
import json
import re
import sys

sys.path[:0] = ["bench/scripts", "."]
from replay_logged import logged_plan  # noqa: E402
from replay_plan import PREFIX  # noqa: E402

from strategies.memferry.cost import predict  # noqa: E402
from strategies.memferry.host_calibration import with_gap  # noqa: E402
from strategies.memferry.links import probed_links  # noqa: E402
from strategies.memferry.profiler import StepProfile  # noqa: E402

CALL = "bench/results/2026-12-06-h100-session43/call1"
CLOCK = re.compile(r"rehearsal clock \d+: steps of ([\d.]+), ([\d.]+) ms; .*?whose work took ([\d.]+), ([\d.]+) ms")
links = probed_links(json.load(open(f"{CALL}/s128/xpu-probe.json")))
for run in ("s128", "s64"):
    text = open(f"{CALL}/{run}/logs/memferry-auto.log").read()
    profile = StepProfile.from_json(next(ln for ln in text.splitlines() if ln.startswith(PREFIX))[len(PREFIX):])
    plan, row = logged_plan(text), json.loads(re.search(r"@@row (\{.*\})", text).group(1))
    margin, measured = row["options"]["memory_margin"], row["step_mean_s"]
    pred = predict(plan, profile, links, margin)
    a_step, b_step, a_work, b_work = map(float, CLOCK.findall(text)[-1])
    gap = min(a_step - a_work, b_step - b_work) / 1e3
    gapped = with_gap(plan, profile, links, margin, gap)
    again = predict(plan, gapped, links, margin)
    print(f"{run}: bound by {pred.bound}; host optimizer {pred.parts['host optimizer'] * 1e3:.1f} ms, host memory "
          f"{pred.parts['host memory'] * 1e3:.1f}, host work {pred.host_optimizer_s * 1e3:.1f}; predicted "
          f"{pred.step_s * 1e3:.1f} ms ({(pred.step_s - measured) / measured:+.1%}); rehearsed gap {gap * 1e3:.1f} ms, "
          f"priced {gapped.host_gap_s * 1e3:.1f} more: {again.step_s * 1e3:.1f} ms "
          f"({(again.step_s - measured) / measured:+.1%}); measured {measured * 1e3:.1f} ms")
