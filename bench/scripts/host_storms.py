"""Diagnostic: the windows in which the host's kernel was busy moving pages, from a host sample file.

    python3 bench/scripts/host_storms.py RESULTS_DIR/host-bench-<system>.txt [--tlb 20000] [--every]

Runs on any machine (no device). Reads what ``sample_host.sh`` wrote beside a bench call (one
line a sample: the time, interrupt totals by kind, then /proc/vmstat totals), turns the totals
into per-second rates, and prints each window where TLB-shootdown interrupts ran over ``--tlb``
a second. For each window it gives the start, end, length, the peak TLB rate, and the page
faults, pages freed, pages migrated and compaction's scanned pages. Why: while a 6.58 B model's
shadow was pinned, up to 480 k TLB shootdowns a second reached the cores of the process's
threads, and such a storm through a rehearsal slowed its host updates 1.3x
(bench/results/2026-12-06-h100-session37/README.md). Last, the TLB rate's correlation with each
counter's, second by second across the storms: in session 38 it followed ``pgmigrate_fail`` at
0.99, compaction failing to move pinned pages (bench/results/2026-12-06-h100-session38/).
``--every`` also prints each sample's rates.
"""
from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass

_PAIR = re.compile(r"([\w]+):?=(\d+)")


@dataclass
class Sample:
    """One line of a host sample file: its clock time and every counter's running total."""

    time: str
    totals: dict[str, int]


@dataclass
class Window:
    """Consecutive seconds over the TLB threshold, with each counter's increase across them."""

    start: str
    end: str
    seconds: int
    peak_tlb: int
    moved: dict[str, int]


def parse(lines: list[str]) -> list[Sample]:
    """Samples from a host sample file's lines (blank or malformed lines are skipped)."""
    samples = []
    for line in lines:
        parts = line.split(maxsplit=1)
        if len(parts) == 2:
            samples.append(Sample(parts[0], {k: int(v) for k, v in _PAIR.findall(parts[1])}))
    return samples


def rates(samples: list[Sample]) -> list[tuple[str, dict[str, int]]]:
    """Each sample's increase over the one before it, by counter (a counter missing from either
    counts 0), stamped with the later sample's time."""
    out = []
    for a, b in zip(samples, samples[1:]):
        keys = a.totals.keys() | b.totals.keys()
        out.append((b.time, {k: b.totals.get(k, 0) - a.totals.get(k, 0) for k in keys}))
    return out


def storms(per_second: list[tuple[str, dict[str, int]]], tlb: int) -> list[Window]:
    """The windows of consecutive samples whose TLB-shootdown rate is over ``tlb``."""
    windows, run = [], []
    for stamp, d in per_second + [("", {})]:  # a sentinel closes the last window
        if d.get("TLB", 0) > tlb:
            run.append((stamp, d))
            continue
        if run:
            moved: dict[str, int] = {}
            for _, r in run:
                for k, v in r.items():
                    moved[k] = moved.get(k, 0) + v
            windows.append(Window(run[0][0], run[-1][0], len(run), max(r.get("TLB", 0) for _, r in run), moved))
            run = []
    return windows


def correlations(per_second: list[tuple[str, dict[str, int]]], windows: list[Window],
                 keys: tuple[str, ...]) -> dict[str, float]:
    """Pearson's correlation of the TLB-shootdown rate with each of ``keys``' rates, second by
    second from the first window's start to the last one's end (quiet seconds between storms
    included); a counter that never moved there is left out."""
    if not windows:
        return {}
    times = [stamp for stamp, _ in per_second]
    span = per_second[times.index(windows[0].start):times.index(windows[-1].end) + 1]
    tlb = [d.get("TLB", 0) for _, d in span]
    out = {}
    for k in keys:
        other = [d.get(k, 0) for _, d in span]
        try:
            out[k] = statistics.correlation(tlb, other)
        except statistics.StatisticsError:  # fewer than two seconds, or a constant rate
            continue
    return out


def main() -> None:
    """Print the storms in one host sample file (and each second's rates with ``--every``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a host-bench-<system>.txt from gpu_bench.sh")
    ap.add_argument("--tlb", type=int, default=20_000, help="TLB shootdowns a sample over which it counts (default 20000)")
    ap.add_argument("--every", action="store_true", help="also print every sample's rates")
    args = ap.parse_args()
    with open(args.path) as fh:
        samples = parse(fh.readlines())
    per_second = rates(samples)
    recorded = set().union(*(s.totals for s in samples))  # older files lack the later counters
    keys = tuple(k for k in ("TLB", "CAL", "pgfault", "pgfree", "pgmigrate_success", "pgmigrate_fail",
                             "compact_isolated", "compact_migrate_scanned") if k in recorded)
    if args.every:
        for stamp, d in per_second:
            print(stamp, " ".join(f"{k} {d.get(k, 0):,}" for k in keys))
    found = storms(per_second, args.tlb)
    print(f"{len(found)} window(s) with over {args.tlb:,} TLB shootdowns a sample, of {len(per_second)} samples")
    for w in found:
        print(f"{w.start} - {w.end} ({w.seconds} samples): peak TLB {w.peak_tlb:,}; "
              + ", ".join(f"{k} {w.moved.get(k, 0):,}" for k in keys if k != "TLB"))
    corr = correlations(per_second, found, tuple(k for k in keys if k != "TLB"))
    if corr:
        print(f"second by second from {found[0].start} to {found[-1].end}, TLB shootdowns correlate with: "
              + ", ".join(f"{k} {r:+.2f}" for k, r in sorted(corr.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
