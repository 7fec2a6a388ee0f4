"""End-to-end `xpu bench` on the cpu backend: outputs, missing DeepSpeed, OOM rows, bad input."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "bench" / "tiny.yaml"
ROW_KEYS = {"system", "status", "params", "step_s", "step_mean_s", "tokens_per_s", "tflops", "peak_device_gb",
            "peak_host_gb", "loss"}


def _xpu_bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "xpu", "bench", *args, "--no-progress"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


#: The example scenario's systems between two more: a torch row capped to run out of memory first
#: (the run must go on past it) and a MemFerry row (its host optimizer's timeline lane). One
#: `xpu bench` for all the tests below: each run costs a CLI, a describe worker and a worker per row.
SYSTEMS = [{"name": "torch", "label": "torch-capped", "device_mem_gb": 1e-5},
           *yaml.safe_load(TINY.read_text())["systems"], {"name": "memferry", "options": {"plan": "prefetch"}}]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    scenario = tmp_path_factory.mktemp("scenario") / "tiny.yaml"
    scenario.write_text(yaml.safe_dump({**yaml.safe_load(TINY.read_text()), "systems": SYSTEMS}))
    out = tmp_path_factory.mktemp("bench-tiny")
    proc = _xpu_bench(str(scenario), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_tiny_writes_json_with_the_schema(tiny_run):
    out, _ = tiny_run
    result = json.loads((out / "results.json").read_text())
    assert {"machine", "date", "command", "scenario", "rows"} <= set(result)
    assert result["command"].startswith("xpu bench")
    assert result["machine_info"]["versions"]["torch"]
    assert result["scenario"]["model"]["family"] == "gpt"
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == [s if isinstance(s, str) else s.get("label", s["name"]) for s in SYSTEMS]
    for label, row in rows.items():
        assert row["status"] in ("ok", "oom", "missing", "error")
        if label != "torch-capped":  # the out-of-memory row has no timings: test_oom_row_and_the_run_goes_on
            assert ROW_KEYS <= set(row), row
    torch_row = rows["torch"]
    assert torch_row["status"] == "ok"
    assert torch_row["params"] > 0 and torch_row["step_s"] > 0 and torch_row["tokens_per_s"] > 0
    assert torch_row["peak_device_gb"] > 0 and torch_row["peak_host_gb"] > 0
    assert len(torch_row["losses"]) == 4 and torch_row["loss_step"] == 4
    assert torch_row["step_mean_s"] >= torch_row["step_min_s"]


def test_fsdp2_runs_the_same_training_as_torch_on_cpu(tiny_run):
    # fp32 everywhere, same seed, same data, same AdamW: the losses must agree.
    out, _ = tiny_run
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    fsdp = rows["fsdp2-offload"]
    assert fsdp["status"] in ("ok", "error"), fsdp
    if fsdp["status"] == "ok":
        assert fsdp["loss"] == pytest.approx(rows["torch"]["loss"], rel=1e-3)
    else:
        assert fsdp["reason"]


def test_deepspeed_rows_read_missing_with_reason(tiny_run):
    out, _ = tiny_run
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"] if r["system_name"].startswith("deepspeed")]
    assert len(rows) == 4
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    for row in rows:
        assert row["status"] == "missing"
        assert "deepspeed" in row["reason"]
    zen = next(r for r in rows if r["system_name"] == "deepspeed-zenflow")
    assert zen["approximate"] is True
    assert zen["steps"] % 2 == 0  # rounded to whole update intervals


def test_markdown_table_and_timeline(tiny_run):
    out, proc = tiny_run
    md = (out / "results.md").read_text()
    assert "| torch | ok |" in md and "missing" in md
    assert "| torch | ok |" in proc.stdout
    result = json.loads((out / "results.json").read_text())
    for row in result["rows"]:
        if row["status"] == "ok":
            trace = json.loads((out / row["timeline"]).read_text())
            assert trace["traceEvents"], row["system"]
            lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
            assert {"compute", "host→device", "device→host", "CPU optimizer"} <= lanes
            assert any(e.get("ph") == "X" and e["cat"] == "compute" for e in trace["traceEvents"])
    assert (out / "logs" / "torch.log").exists()


def test_merge_two_runs(tiny_run, tmp_path, capsys):
    from xpu.cli import main

    out, _ = tiny_run
    first = json.loads((out / "results.json").read_text())
    part = dict(first, rows=[r for r in first["rows"] if r["system"] != "torch"])
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps(part))
    assert main(["bench", "--merge", str(tmp_path / "a" / "results.json"), str(out / "results.json"),
                 "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert sorted(r["system"] for r in merged["rows"]) == sorted(r["system"] for r in first["rows"])
    torch_row = next(r for r in merged["rows"] if r["system"] == "torch")
    assert (tmp_path / "m" / torch_row["timeline"]).exists()


def test_plot_written_or_skipped_with_a_note(tiny_run):
    out, proc = tiny_run
    result = json.loads((out / "results.json").read_text())
    if importlib.util.find_spec("matplotlib") is None:
        assert result["plot_skipped"] == "plot skipped: matplotlib not installed"
        assert "plot skipped: matplotlib not installed" in proc.stdout
    else:
        assert (out / result["plot"]).stat().st_size > 0


def test_oom_row_and_the_run_goes_on(tiny_run):
    """The first row runs out of memory; the torch row after it (a fresh worker) trains."""
    out, _ = tiny_run
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["status"] for r in rows[:2]] == ["oom", "ok"] and rows[1]["system"] == "torch"
    assert "out of memory" in rows[0]["reason"] and rows[0]["device_mem_gb"] == 1e-5
    assert "| torch-capped | OOM |" in (out / "results.md").read_text()


def test_bad_input_fails_before_running(tmp_path, capsys, monkeypatch):
    from xpu.cli import main

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    assert main(["bench", str(TINY), "--systems", "nonesuch", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "nonesuch" in err and "deepspeed-z2-offload" in err
    assert not (tmp_path / "x").exists()
    assert main(["bench", "no-such-scenario"]) == 2
    assert "tiny" in capsys.readouterr().err  # lists the named scenarios
    assert main(["bench", str(TINY), "--set", "model.family=bert"]) == 2
    assert "valid families" in capsys.readouterr().err


def test_list_systems(capsys):
    from xpu.cli import main

    assert main(["bench", "--list-systems"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "fsdp2-offload", "deepspeed-z3-offload", "deepspeed-zenflow"):
        assert name in out


def test_memferry_timeline_puts_host_updates_on_the_cpu_optimizer_lane(tiny_run):
    """MemFerry's host AdamW runs in its own thread; its per-block spans must reach the timeline
    (the tiny scenario's 2-layer GPT, fp32, timeline on)."""
    out, _ = tiny_run
    assert json.loads((out / "results.json").read_text())["scenario"]["timeline"] is True
    trace = json.loads((out / "timelines" / "memferry.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if str(e.get("name", "")).startswith("optimizer:host")]
    assert {e["name"] for e in spans} == {"optimizer:host blocks.0", "optimizer:host blocks.1", "optimizer:host rest"}
    assert {lanes[(e["pid"], e["tid"])] for e in spans} == {"CPU optimizer"}


def test_a_signal_ending_the_runner_kills_its_live_workers(tmp_path):
    """Workers run in their own sessions (so a timeout can kill their children too), so a
    SIGTERM to the runner (``timeout xpu bench ...``) would not reach them: the runner kills
    them itself, or they would hold the device into the next run."""
    import signal
    import time

    script = tmp_path / "runner.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from bench import runner\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "runner._install_signal_handlers()\n"
        "runner._LIVE_GROUPS.add(p.pid)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    worker = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM  # ended as SIGTERM ends it, after the cleanup
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as fh:  # a zombie awaiting its reaper is dead too
            if fh.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived the runner")


def test_an_exact_system_whose_loss_departs_from_torch_is_flagged_not_the_approximate_one():
    from bench.report import flag_loss_outliers, markdown_table

    def row(label, name, loss, approximate=False):
        return {"system": label, "system_name": name, "status": "ok", "loss": loss, "loss_step": 9,
                "approximate": approximate}

    rows = [row("torch", "torch", 0.010), row("fsdp2-offload", "fsdp2-offload", 0.011),
            row("deepspeed-z3-offload", "deepspeed-z3-offload", 207.0), row("zenflow", "deepspeed-zenflow", 5.7, True)]
    flag_loss_outliers(rows)
    flagged = {r["system"] for r in rows if r.get("loss_flag")}
    assert flagged == {"deepspeed-z3-offload"}
    assert "departs from 0.010 (torch) at step 9" in rows[2]["loss_flag"]
    # without a torch row, the median of three or more exact rows is the reference; two are never judged
    rest = rows[1:3]
    flag_loss_outliers(rest)
    assert not any(r.get("loss_flag") for r in rest)
    flag_loss_outliers(rows)
    result = {"scenario": {"name": "s", "model": {"family": "gpt"}, "batch": 1, "seq": 1, "dtype": "fp32"},
              "machine": "m", "date": "d", "command": "c", "rows": rows}
    assert "| deepspeed-z3-offload | ok, loss? | " in markdown_table(result)


def test_a_lora_row_is_judged_only_beside_rows_training_the_same_adapter():
    from bench.report import flag_loss_outliers

    lora = {"r": 16, "alpha": 32}

    def row(label, loss, options=None):
        return {"system": label, "system_name": label.split("-")[0], "status": "ok", "loss": loss, "loss_step": 5,
                "options": options or {}}

    # Qwen2-1.5B on the H200 (2026-12-02): full fine-tuning fell to 7.5 while the adapter read 12.2.
    rows = [row("memferry-full", 7.53), row("fsdp2-offload", 7.53), row("deepspeed-z3", 7.29),
            row("memferry-lora", 12.16, {"lora": lora})]
    flag_loss_outliers(rows)
    assert not any(r.get("loss_flag") for r in rows)
    rows += [row("other-lora", 12.2, {"lora": lora}), row("broken-lora", 207.0, {"lora": lora})]
    rows[1]["loss"] = 20.0  # a broken full fine-tune is still caught among the full ones
    flag_loss_outliers(rows)
    assert {r["system"] for r in rows if r.get("loss_flag")} == {"broken-lora", "fsdp2-offload"}


def test_steps_after_a_clip_are_timed_apart_from_the_others():
    from bench.worker import _time_clipped_apart

    row = {"step_times_s": [9.0, 0.2, 0.3, 0.1, 0.3, 0.1], "clipped": [True, True, False, True, False, False]}
    _time_clipped_apart(row, warmup=1, steps=4)  # the warm-up's 9.0 and the untimed last 0.1 stay out
    # timed steps 1, 2 and 4 follow clipped steps 0, 1 and 3; step 3 follows unclipped step 2
    assert row["after_clip_timed"] == 3
    assert row["step_mean_after_clip_s"] == pytest.approx((0.2 + 0.3 + 0.3) / 3, abs=1e-5)  # rounded to 10 us
    assert row["step_mean_after_no_clip_s"] == 0.1
    never = {"step_times_s": [0.1, 0.2], "clipped": [False, False]}
    _time_clipped_apart(never, warmup=0, steps=2)
    assert never["step_mean_after_clip_s"] is None and never["after_clip_timed"] == 0
    unsaid = {"step_times_s": [0.1, 0.2]}
    _time_clipped_apart(unsaid, warmup=0, steps=2)
    assert unsaid == {"step_times_s": [0.1, 0.2]}  # a system that does not say adds nothing
    assert "predicted_at_firing_s" not in row  # no predictions, no mix


def test_a_clipped_row_s_prediction_mixes_its_two_as_the_timed_steps_fell():
    """Three of the four timed steps follow a clip: the mean predicted is three parts the step
    after a clip and one part the unclipped step."""
    from bench.worker import _time_clipped_apart

    row = {"step_times_s": [9.0, 0.2, 0.3, 0.1, 0.3, 0.1], "clipped": [True, True, False, True, False, False],
           "predicted_step_s": 0.1, "predicted_after_clip_step_s": 0.3}
    _time_clipped_apart(row, warmup=1, steps=4)
    assert row["predicted_at_firing_s"] == pytest.approx((3 * 0.3 + 0.1) / 4)
    calm = {"step_times_s": [0.1, 0.2, 0.2], "clipped": [False, False, False],
            "predicted_step_s": 0.18, "predicted_after_clip_step_s": 0.3}
    _time_clipped_apart(calm, warmup=1, steps=2)
    assert calm["predicted_at_firing_s"] == pytest.approx(0.18)  # no step followed a clip


def test_a_clipped_memferry_row_says_which_steps_clipped(cpu_backend):
    from bench.scenario import load_scenario
    from bench.worker import run_spec

    system = {"name": "memferry", "label": "mf-clip", "options": {"plan": "auto", "max_grad_norm": 1e-4}}
    scenario = load_scenario("tiny", {"systems": [system], "steps": 2, "warmup": 1, "loss_after": 3, "timeline": False})
    row = run_spec({"scenario": scenario.to_dict(), "label": "mf-clip", "timeline_path": None}, in_process=True)
    assert row["status"] == "ok", row
    assert row["clipped"] == [True] * len(row["step_times_s"]) and all(n > 1e-4 for n in row["grad_norms"])
    assert row["after_clip_timed"] == 2 and row["step_mean_after_no_clip_s"] is None
    assert row["step_mean_after_clip_s"] == pytest.approx(sum(row["step_times_s"][1:3]) / 2, abs=1e-5)
    # the training thread's time queuing gradients home is a part of each step's
    assert 0 < row["grad_post_ms_per_step"] < 1e3 * sum(row["step_times_s"]) / len(row["step_times_s"])
    assert row["issuing_wait_ms_per_step"] >= 0  # the issuing threads' waits for a core (0 off Linux)
    # per step, the host's work and the training thread's wait for it: a step's updates are done
    # by the next step's forward at the latest, so the steps after the first have some
    assert len(row["host_work_ms_steps"]) == len(row["consumer_wait_ms_steps"]) == len(row["step_times_s"])
    assert sum(row["host_work_ms_steps"][1:]) > 0 and min(row["consumer_wait_ms_steps"]) >= 0
    assert row["predicted_after_clip_step_s"] >= row["predicted_step_s"] > 0  # a fired clip never speeds a step
    # both timed steps followed a clip: their mean's prediction is the after-a-clip one
    assert row["predicted_at_firing_s"] == pytest.approx(row["predicted_after_clip_step_s"])
    # a planned row says what its plan priced the host's work at, beside what it took
    assert row["host_planned_update_ns_per_param"] > 0 and row["host_update_ns_per_param"] > 0
    assert row["host_planned_earlier_ns_per_param"] == row["host_earlier_ns_per_param"] == 0  # one micro-batch


def test_a_memferry_row_carries_its_rehearsal_s_last_step(cpu_backend, monkeypatch):
    """Where the rehearsal is timed (real devices; turned on here), the row says what its last
    step took beside the prediction, before any training step."""
    from bench.scenario import load_scenario
    from bench.worker import run_spec

    from strategies.memferry.host_optimizer import HostOptimizer
    from tests.rehearsal_here import rehearse_here

    rehearse_here(monkeypatch)
    # The host's rate as this machine measured it could make another plan (untimed): none measured.
    monkeypatch.setattr(HostOptimizer, "split_since", lambda self, start: None)
    system = {"name": "memferry", "label": "mf", "device_mem_gb": 1, "options": {"plan": "auto"}}  # a budget: rehearsed
    scenario = load_scenario("tiny", {"systems": [system], "steps": 1, "warmup": 0, "loss_after": 1, "timeline": False})
    row = run_spec({"scenario": scenario.to_dict(), "label": "mf", "timeline_path": None}, in_process=True)
    assert row["status"] == "ok", row
    assert row["rehearsal_step_s"] > 0 and f"rehearsed {row['rehearsal_step_s']:.3f} s)" in row["notes"], row["notes"]
    assert len(row["gc_full_ms_steps"]) == len(row["step_times_s"])  # full GC pauses, step by step


def test_full_collections_are_timed_in_the_step_they_fall_in():
    """A full collection counts in the step it ran in, a younger one in none; the clock stops
    listening when left."""
    import gc

    from xpu.gc_clock import FullCollections

    with FullCollections() as clock:
        gc.collect()  # generation 2
        clock.step_done()
        gc.collect(0)
        clock.step_done()
    assert clock.steps[0] > 0 and clock.steps[1] == 0
    assert clock._observe not in gc.callbacks


def test_a_row_whose_timed_steps_a_full_gc_paused_says_so():
    """The markdown notes count the timed steps (warm-up left out) a full collection paused."""
    from bench.report import _gc_note

    row = {"warmup": 1, "steps": 3, "gc_full_ms_steps": [150.0, 0.0, 130.0, 2.0, 140.0]}
    assert _gc_note(row) == "full GC 130 ms in 1 of 3 timed steps; "
    assert _gc_note({**row, "gc_full_ms_steps": [150.0, 0.0, 2.0, 0.0]}) == ""
    assert _gc_note({"warmup": 1, "steps": 3}) == ""  # rows from before the clock
