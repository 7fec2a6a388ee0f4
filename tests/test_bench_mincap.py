"""Smallest-cap search (``xpu bench --min-cap``) on the cpu backend: the right cap, a journal that
resumes, rows that merge beside an ordinary run's, and bad input refused in one line."""
from __future__ import annotations

import json

import pytest

from bench.scenario import load_scenario
from bench.search import search_smallest


@pytest.mark.parametrize("limit", [0, 1, 5, 9, 10, 17, 20])
@pytest.mark.parametrize("guess", [None, "right", "low", "high", "far"])
@pytest.mark.parametrize("lo_fails", [True, False])
def test_search_smallest_finds_the_boundary(limit, guess, lo_fails):
    calls = []

    def passes(k):
        calls.append(k)
        return k >= limit

    if lo_fails and limit == 0:
        return  # index 0 fails by definition there
    g = {None: None, "right": limit, "low": limit - 1, "high": limit + 1, "far": 3}[guess]
    found = search_smallest(passes, 0, 20, lo_fails=lo_fails, guess=None if g is None else (lambda: g))
    assert found == (None if limit > 20 else limit)
    assert len(calls) == len(set(calls))  # no cap is tried twice
    if lo_fails:
        assert 0 not in calls
    if guess == "right" and 1 < limit < 20:
        assert len(calls) == 3  # the top, the guess, the one below it


def test_search_smallest_none_when_even_the_top_fails():
    assert search_smallest(lambda k: False, 0, 8, lo_fails=True, guess=lambda: 4) is None


def _tiny(**over):
    return load_scenario("tiny", {"systems": ["torch", "fsdp2-offload"], "steps": 1, "warmup": 0, "model.layers": 1,
                                  "min_cap": {"resolution": 0.0002}, **over})


def test_min_cap_finds_the_smallest_cap_and_a_rerun_goes_on_from_the_journal(cpu_backend, tmp_path, monkeypatch):
    """On the cpu backend "fits" is decided by the virtual device's capacity: the cap found
    passes, the one a resolution step below fails with OOM, and the uncapped trial's peak lies
    between them. FSDP2 runs untracked there (no cap binds it): its row says so. A rerun into
    the same folder takes finished trials from the journal; one cut short runs only the rest."""
    from bench import worker
    from bench.mincap import run_min_cap

    ran = []
    real = worker.run_spec

    def counting(spec, **kw):
        ran.append(spec["scenario"]["device_mem_gb"])
        return real(spec, **kw)

    monkeypatch.setattr(worker, "run_spec", counting)
    result = run_min_cap(_tiny(), tmp_path, progress=False, spawn=False)
    rows = {r["system"]: r for r in result["rows"]}
    torch_row = rows["torch"]
    assert torch_row["status"] == "ok", torch_row
    cap, below = torch_row["min_cap_gb"], torch_row["failed_below"]
    assert torch_row["trials"][0]["device_mem_gb"] is None  # the top: uncapped
    assert below["device_mem_gb"] == pytest.approx(cap - 0.0002) and below["status"] == "oom"
    assert "out of memory" in below["reason"]
    assert len(torch_row["trials"]) == 3  # uncapped, the cap at its peak, the one below
    # the full row of the passing trial at that cap
    assert torch_row["device_mem_gb"] == cap and torch_row["step_s"] > 0 and torch_row["loss"] > 0
    assert torch_row["loss_step"] == 1 and torch_row["peak_device_gb"] <= cap
    assert torch_row["notes"].startswith(f"smallest cap {cap:g} GB at 0.0002 GB resolution (below: "
                                         f"{below['device_mem_gb']:g} GB: oom)")
    assert rows["fsdp2-offload"]["status"] == "error" and "not tracked" in rows["fsdp2-offload"]["reason"]
    md = (tmp_path / "min_cap.md").read_text()
    assert f"| torch | ok | {cap:g} | {below['device_mem_gb']:g} GB: oom" in md

    n = len(torch_row["trials"])
    ran.clear()
    again = run_min_cap(_tiny(), tmp_path, progress=False, spawn=False, systems=["torch"])
    assert not ran and all(t["reused"] for t in again["rows"][0]["trials"])
    assert again["rows"][0]["min_cap_gb"] == cap
    journal = tmp_path / "min_cap_trials.jsonl"
    journal.write_text(journal.read_text().splitlines()[0] + "\n")  # cut short after the first trial
    cut = run_min_cap(_tiny(), tmp_path, progress=False, spawn=False, systems=["torch"])
    assert cut["rows"][0]["min_cap_gb"] == cap and cut["rows"][0]["trials"][0].get("reused")
    assert len(ran) == n - 1  # every trial but the journaled one ran again

    # beside an ordinary run: one results table, each row with its own cap
    plain = json.loads((tmp_path / "min_cap.json").read_text())
    plain["rows"] = [{"system": "memferry", "status": "ok", "step_s": 0.1, "step_mean_s": 0.1, "device_mem_gb": 0.001}]
    (tmp_path / "results.json").write_text(json.dumps(plain))
    from bench.report import merge_results

    merged = merge_results([tmp_path / "results.json", tmp_path / "min_cap.json"], tmp_path / "m")
    assert merged["outputs"]["markdown"].endswith("results.md")
    table = (tmp_path / "m" / "results.md").read_text()
    assert "| memferry | ok |" in table and "cap 0.001 GB" in table
    assert "| torch | ok |" in table and f"smallest cap {cap:g} GB" in table


@pytest.mark.parametrize("args,says", [
    (["--cap-range", "8:4"], "empty or reversed"),
    (["--cap-resolution", "0"], "must be a positive number of GB"),
    (["--cap-range", "x:4"], "--cap-range takes LO:HI"),
    (["--max-model"], "one at a time"),
    (["--device-mem-gb", "8"], "drop --device-mem-gb"),
])
def test_min_cap_bad_input_is_one_line_and_exit_2(args, says, tmp_path, capsys, monkeypatch):
    from xpu.cli import main

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    assert main(["bench", "tiny", "--min-cap", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()
    assert main(["bench", "tiny", "--cap-range", "4:8"]) == 2  # a search flag without its search
    assert "add --min-cap" in capsys.readouterr().err
