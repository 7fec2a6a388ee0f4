"""bench/scripts/host_storms.py: storm windows from the running totals sample_host.sh writes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def host_storms():
    spec = importlib.util.spec_from_file_location("host_storms", ROOT / "bench" / "scripts" / "host_storms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _line(t: str, tlb: int, cal: int, pgfault: int, migrated: int) -> str:
    # the layout sample_host.sh writes: time, interrupt totals by kind, "|", vmstat totals
    return f"{t} CAL:={cal} TLB:={tlb} 31:=5 | pgfault={pgfault} pgmigrate_success={migrated} \n"


def test_totals_become_rates_and_runs_over_the_threshold_become_windows(host_storms):
    lines = [_line("00:00:00", 0, 0, 0, 0),
             _line("00:00:01", 10, 10, 100, 0),          # quiet
             _line("00:00:02", 50_010, 50_010, 600, 7),  # storm
             _line("00:00:03", 150_010, 150_010, 900, 9),  # storm, the peak
             _line("00:00:04", 150_020, 150_020, 950, 9),  # quiet again
             "\n",
             _line("00:00:05", 180_020, 180_020, 1_000, 9)]  # a second storm, to the end
    samples = host_storms.parse(lines)
    assert len(samples) == 6 and samples[1].totals == {"CAL": 10, "TLB": 10, "31": 5, "pgfault": 100,
                                                       "pgmigrate_success": 0}
    per_second = host_storms.rates(samples)
    assert [d["TLB"] for _, d in per_second] == [10, 50_000, 100_000, 10, 30_000]
    windows = host_storms.storms(per_second, tlb=20_000)
    assert [(w.start, w.end, w.seconds, w.peak_tlb) for w in windows] == [
        ("00:00:02", "00:00:03", 2, 100_000), ("00:00:05", "00:00:05", 1, 30_000)]
    assert windows[0].moved["pgfault"] == 800 and windows[0].moved["pgmigrate_success"] == 9
    assert windows[0].moved["TLB"] == 150_000
    assert host_storms.storms(per_second, tlb=200_000) == []


def test_the_storms_correlation_names_the_counter_that_moves_with_them(host_storms):
    """Across the storms' span the TLB rate follows failed migrations, not page faults."""
    fails, faults, tlb = [0, 100, 900, 50, 700, 0], [500, 400, 450, 600, 380, 500], [0, 120, 1_000, 60, 810, 5]
    lines, totals = [], {"TLB": 0, "pgmigrate_fail": 0, "pgfault": 0}
    for t, (dt, df, dp) in enumerate(zip(tlb, fails, faults)):
        totals = {"TLB": totals["TLB"] + dt, "pgmigrate_fail": totals["pgmigrate_fail"] + df,
                  "pgfault": totals["pgfault"] + dp}
        lines.append(f"00:00:0{t} TLB:={totals['TLB']} | pgmigrate_fail={totals['pgmigrate_fail']} "
                     f"pgfault={totals['pgfault']} pgfree=7\n")
    per_second = host_storms.rates(host_storms.parse(lines))
    windows = host_storms.storms(per_second, tlb=500)
    assert [(w.start, w.end) for w in windows] == [("00:00:02", "00:00:02"), ("00:00:04", "00:00:04")]
    corr = host_storms.correlations(per_second, windows, ("pgmigrate_fail", "pgfault", "pgfree"))
    assert set(corr) == {"pgmigrate_fail", "pgfault"}  # pgfree never moved: no correlation to give
    assert corr["pgmigrate_fail"] > 0.99 and corr["pgfault"] < 0
    assert host_storms.correlations(per_second, [], ("pgfault",)) == {}
