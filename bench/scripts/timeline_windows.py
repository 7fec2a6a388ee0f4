"""Diagnostic: a bench timeline's step cut into micro-batches, and what each lane did in each.

    python3 bench/scripts/timeline_windows.py RESULTS_DIR/timelines/memferry-auto.json[.gz]

Runs on any machine (no device). Reads one profiled step (``timelines/<system>.json``, or its
gzip) and splits it at the device's ``bench:forward`` phases: per micro-batch, the forward
window (until that phase ends) and the backward window (until the next micro-batch's forward),
with the time the compute, host-to-device and device-to-host lanes were busy in each (overlaps
counted once) and the mean time of a whole-block load (host-to-device copies over 1 ms). Then the compute lane's idle gaps: their total, the part while host-to-device
copies ran (a link-bound pass) and the rest; and the gaps where the load stream idled too (the
training thread late to issue both), with how much of them fell in backward and beside gradient
copies home. Which micro-batches ran slower than the others, and
with what beside them, is what the cost model's per-micro-batch terms are checked against.
"""
from __future__ import annotations

import argparse
import gzip
import json


def _spans(events: list[dict], lane: str, t0: float) -> list[tuple[float, float]]:
    return sorted(((e["ts"] - t0) / 1e3, (e["ts"] - t0 + e["dur"]) / 1e3) for e in events if e["cat"] == lane)


def busy(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Milliseconds of ``[a, b]`` covered by at least one of ``spans``."""
    total, cur = 0.0, None
    for s, e in spans:
        s, e = max(s, a), min(e, b)
        if e <= s:
            continue
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (0.0 if cur is None else cur[1] - cur[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", help="a bench timeline (Chrome trace JSON, optionally gzipped)")
    args = ap.parse_args()
    opener = gzip.open if args.timeline.endswith(".gz") else open
    with opener(args.timeline, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in events)
    comp, h2d, d2h = (_spans(events, lane, t0) for lane in ("compute", "h2d", "d2h"))
    end = max(e for _, e in comp)
    # The device's forward phases; a nested one (the loss's slices) starts inside the one before it.
    fwd: list[tuple[float, float]] = []
    for e in sorted((e for e in events if e["name"] == "bench:forward" and e["cat"] == "device_phases"),
                    key=lambda e: e["ts"]):
        s = (e["ts"] - t0) / 1e3
        if not fwd or s >= fwd[-1][1]:
            fwd.append((s, s + e["dur"] / 1e3))
    # Whole-block copies host to device (over 1 ms), to see their rate change between windows.
    loads = [(s, e - s) for s, e in h2d if e - s > 1.0]

    def per_load(a: float, b: float) -> str:
        took = [d for s, d in loads if a <= s < b]
        return f"{sum(took) / len(took):.2f}" if took else "-"

    print("| micro-batch | ms | forward ms | compute | h2d | ms per load | backward ms | compute | h2d | ms per load "
          "| d2h |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (s, f) in enumerate(fwd):
        nxt = fwd[i + 1][0] if i + 1 < len(fwd) else end
        print(f"| {i} | {nxt - s:.1f} | {f - s:.1f} | {busy(comp, s, f):.1f} | {busy(h2d, s, f):.1f} | {per_load(s, f)} | "
              f"{nxt - f:.1f} | {busy(comp, f, nxt):.1f} | {busy(h2d, f, nxt):.1f} | {per_load(f, nxt)} | "
              f"{busy(d2h, f, nxt):.1f} |")
    merged: list[list[float]] = []
    for s, e in comp:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:])]
    linked = sum(b - a for a, b in gaps if busy(h2d, a, b) > 0.5 * (b - a))
    total = sum(b - a for a, b in gaps)
    print(f"\nstep {end:.1f} ms; compute busy {busy(comp, 0, end):.1f}, h2d {busy(h2d, 0, end):.1f}, d2h "
          f"{busy(d2h, 0, end):.1f}; compute idle {total:.1f} ms: {linked:.1f} while h2d copies ran, "
          f"{total - linked:.1f} otherwise")
    # Both streams the training thread feeds idle at once: the time of compute gaps over half a
    # millisecond with no load running either (the thread was late to issue both).
    long_gaps = [(a, b) for a, b in gaps if b - a > 0.5]
    backward = [(f, fwd[i + 1][0] if i + 1 < len(fwd) else end) for i, (_, f) in enumerate(fwd)]

    def both_idle(spans: list[tuple[float, float]]) -> float:
        return sum(b - a - busy(h2d, a, b) for a, b in spans)

    in_bwd = both_idle([(a, b) for a, b in long_gaps if any(lo <= a < hi for lo, hi in backward)])
    homeward = both_idle([(a, b) for a, b in long_gaps if busy(d2h, a, b) > 0.5 * (b - a)])
    print(f"compute and h2d both idle in compute gaps over 0.5 ms: {both_idle(long_gaps):.1f} ms over "
          f"{len(long_gaps)} gaps ({in_bwd:.1f} in backward windows; {homeward:.1f} in gaps while gradient copies "
          f"home ran)")

if __name__ == "__main__":
    main()
