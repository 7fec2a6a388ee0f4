"""Largest-model search on the cpu backend: returns max_params and a config, monotone in the cap."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.maxmodel import max_model_for_system, search_largest
from bench.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("limit,lo,hi", [(1, 1, 64), (7, 1, 64), (64, 1, 64), (100, 1, 64), (13, 3, 20), (2, 3, 20)])
def test_search_largest_finds_the_boundary(limit, lo, hi):
    calls = []

    def fits(k):
        calls.append(k)
        return k <= limit

    expected = None if limit < lo else min(limit, hi)
    assert search_largest(fits, lo, hi) == expected
    assert len(calls) <= 2 * max(1, hi - lo).bit_length() + 2


@pytest.mark.parametrize("limit,resolution", [(37, 8), (40, 8), (41, 8), (100, 16), (9, 4), (37, 1)])
def test_search_largest_at_a_resolution_stops_within_it_and_saves_trials(limit, resolution):
    calls = []

    def fits(k):
        calls.append(k)
        return k <= limit

    found = search_largest(fits, 8, 128, resolution)
    assert found <= limit < found + resolution or (resolution == 1 and found == limit)
    exact_calls = []
    search_largest(lambda k: exact_calls.append(k) or k <= limit, 8, 128)
    assert len(calls) <= len(exact_calls) and (resolution == 1 or len(calls) < len(exact_calls) or limit == found)


def test_max_model_row_says_when_resolution_left_values_untried(cpu_backend):
    # At 3 MB the exact search finds 3 layers (4 runs out); at resolution 8 it stops at 2.
    scenario = load_scenario("tiny", {"device_mem_gb": 0.003, "systems": ["torch"],
                                      "max_model": {"knob": "layers", "lo": 1, "hi": 64, "steps": 1, "warmup": 0}})
    exact = max_model_for_system(scenario, "torch", spawn=False)
    scenario.max_model.resolution = 8
    coarse = max_model_for_system(scenario, "torch", spawn=False)
    assert coarse["status"] == "ok" and coarse["max_value"] <= exact["max_value"] < coarse["max_value"] + 8
    assert len(coarse["trials"]) < len(exact["trials"])
    assert coarse["max_value"] < exact["max_value"] and "resolution 8" in coarse["reason"], coarse


def test_max_model_resolution_must_be_positive():
    from bench.scenario import ScenarioError

    with pytest.raises(ScenarioError, match="max_model.resolution"):
        load_scenario("tiny", {"max_model": {"resolution": 0}})


def _scenario(cap_gb):
    return load_scenario("tiny", {"device_mem_gb": cap_gb, "systems": ["torch"],
                                  "max_model": {"knob": "layers", "lo": 1, "hi": 64, "steps": 1, "warmup": 0}})


def test_max_model_in_process_is_monotone_in_the_cap(cpu_backend):
    results = []
    for cap in (0.002, 0.003, 0.004):  # 1, 3 and 4 layers: small caps keep the trials' models small
        row = max_model_for_system(_scenario(cap), "torch", spawn=False)
        assert row["status"] == "ok", row
        assert row["max_params"] > 0 and row["max_config"]["layers"] == row["max_value"]
        assert any(t["status"] == "oom" for t in row["trials"])  # the boundary was found, not the range top
        results.append(row["max_params"])
    assert results == sorted(results) and results[0] < results[-1]


def test_max_model_too_small_cap_reads_oom(cpu_backend):
    row = max_model_for_system(_scenario(1e-5), "torch", spawn=False)
    assert row["status"] == "oom" and row["max_params"] is None


def test_cli_max_model_writes_rows_with_max_params(tmp_path):
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT))
    # 2 MB holds 1 layer, not 2: two trials (a worker each) find the boundary.
    proc = subprocess.run([sys.executable, "-m", "xpu", "bench", "tiny", "--max-model", "--systems",
                           "torch,deepspeed-z2-offload", "--device-mem-gb", "0.002", "--host-mem-gb", "64",
                           "--knob-range", "1:2", "--out", str(tmp_path), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "max_model.json").read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["torch"]["status"] == "ok" and rows["torch"]["max_params"] > 0
    assert rows["torch"]["max_config"]["layers"] == 1
    assert [t["status"] for t in rows["torch"]["trials"]] == ["ok", "oom"], rows["torch"]["trials"]
    assert rows["deepspeed-z2-offload"]["status"] in ("missing", "ok", "error")
    assert "| torch | ok |" in (tmp_path / "max_model.md").read_text()


def test_a_rerun_into_the_same_folder_reuses_finished_trials(cpu_backend, tmp_path, monkeypatch):
    """A search cut short (a device call's time limit) goes on where it stopped: finished
    trials come from the journal, keyed by machine and trial scenario; others run."""
    from bench import worker
    from bench.maxmodel import TrialJournal

    ran = []
    real = worker.run_spec

    def counting(spec, **kw):
        ran.append(spec["scenario"]["model"]["layers"])
        return real(spec, **kw)

    monkeypatch.setattr(worker, "run_spec", counting)
    journal = TrialJournal(tmp_path / "max_model_trials.jsonl", "machine-a")
    # 3 MB then 4 MB: small caps keep the trials' models small.
    first = max_model_for_system(_scenario(0.003), "torch", spawn=False, journal=journal)
    assert first["status"] == "ok" and ran and not any(t.get("reused") for t in first["trials"])
    n = len(ran)
    again = max_model_for_system(_scenario(0.003), "torch", spawn=False,
                                 journal=TrialJournal(tmp_path / "max_model_trials.jsonl", "machine-a"))
    assert len(ran) == n  # nothing ran again
    assert again["max_params"] == first["max_params"] and all(t["reused"] for t in again["trials"])
    other = max_model_for_system(_scenario(0.003), "torch", spawn=False,
                                 journal=TrialJournal(tmp_path / "max_model_trials.jsonl", "machine-b"))
    assert len(ran) == 2 * n and other["max_params"] == first["max_params"]  # another machine: every trial ran
    bigger = max_model_for_system(_scenario(0.004), "torch", spawn=False, journal=journal)
    assert len(ran) > 2 * n and bigger["max_params"] >= first["max_params"]  # another cap: another trial scenario


def test_max_model_results_of_separate_searches_merge_into_one_table(cpu_backend, tmp_path):
    """Searches run apart (one per system, each over its own range) merge into one max_model.json;
    each row keeps its range, and results of the two kinds refuse to mix."""
    from bench.maxmodel import run_max_model
    from bench.report import merge_results

    a = load_scenario("tiny", {"device_mem_gb": 0.003, "systems": ["torch", {"name": "torch", "label": "torch-r"}],
                               "max_model": {"knob": "layers", "lo": 1, "hi": 8, "steps": 1, "warmup": 0}})
    run_max_model(a.select(["torch"]), tmp_path / "a", progress=False, spawn=False)
    b = load_scenario("tiny", {"device_mem_gb": 0.003, "systems": ["torch", {"name": "torch", "label": "torch-r"}],
                               "max_model": {"knob": "layers", "lo": 2, "hi": 4, "steps": 1, "warmup": 0}})
    run_max_model(b.select(["torch-r"]), tmp_path / "b", progress=False, spawn=False)
    merged = merge_results([tmp_path / "a" / "max_model.json", tmp_path / "b" / "max_model.json"], tmp_path / "m")
    rows = {r["system"]: r for r in merged["rows"]}
    assert set(rows) == {"torch", "torch-r"} and rows["torch"]["knob_range"] == [1, 8]
    assert rows["torch-r"]["knob_range"] == [2, 4]
    md = (tmp_path / "m" / "max_model.md").read_text()
    assert "| torch | ok |" in md and "| torch-r | ok |" in md and "[2, 4] " in md
    assert "merged by `xpu bench --merge` from" in md and str(tmp_path / "b" / "max_model.json") in md
    assert json.loads((tmp_path / "m" / "max_model.json").read_text())["rows"] == merged["rows"]
    plain = json.loads((tmp_path / "a" / "max_model.json").read_text())
    plain["rows"] = [{"system": "torch", "status": "ok", "step_s": 0.1}]  # a results.json's row
    (tmp_path / "results.json").write_text(json.dumps(plain))
    with pytest.raises(ValueError, match="one kind at a time"):
        merge_results([tmp_path / "a" / "max_model.json", tmp_path / "results.json"], tmp_path / "x")
