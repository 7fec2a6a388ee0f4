"""MPress registered in `xpu bench` (system `mpress`): runs next to `torch` and matches its loss (cpu backend)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from xpu import Capabilities

from bench.systems import get_system
from bench.systems.base import SystemContext

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "bench" / "tiny.yaml"
#: Device cap for the planned run (tiny GPT with 4 layers, batch 8, seq 128, 2 stages): over the last stage's
#: peak, under the first stage's peak with every activation kept.
CAP_GB = 0.0097


def _scenario(tmp_path: Path, systems: list, **overrides) -> Path:
    scen = yaml.safe_load(TINY.read_text())
    scen["model"]["layers"] = 4
    scen.update({"batch": 8, "seq": 128, "steps": 2, "warmup": 1, "loss_after": 3, "systems": systems}, **overrides)
    scen.pop("max_model", None)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scen))
    return path


def _xpu_bench(scenario: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT), XPU_COLLECTIVE_TIMEOUT_S="60")
    return subprocess.run([sys.executable, "-m", "xpu", "bench", str(scenario), "--out", str(out), "--no-timeline",
                           "--no-progress", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_mpress_is_registered_with_its_options():
    spec = get_system("mpress")
    assert spec.target == "bench.systems.mpress:make"
    assert spec.options == {"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "auto"}


def test_mpress_matches_torch_loss(tmp_path):
    systems = ["torch", {"name": "mpress", "options": {"stages": 2, "microbatches": 4, "plan": "keep"}},
               # A cap under the first stage's unplanned peak: the planner must move its activations
               # (and the options reach the stages: another schedule).
               {"name": "mpress", "label": "mpress-capped", "device_mem_gb": CAP_GB,
                "options": {"stages": 2, "microbatches": 2, "schedule": "gpipe"}}]
    out = tmp_path / "out"
    proc = _xpu_bench(_scenario(tmp_path, systems), out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"torch", "mpress", "mpress-capped"}
    for label, row in rows.items():
        assert row["status"] == "ok", (label, row.get("reason"))
    ref = rows["torch"]
    for label in ("mpress", "mpress-capped"):
        row = rows[label]
        assert row["loss_step"] == ref["loss_step"] == 3
        assert abs(row["loss"] - ref["loss"]) < 1e-5, (label, row["losses"], ref["losses"])
        for a, b in zip(row["losses"], ref["losses"]):
            assert abs(a - b) < 1e-4, (label, row["losses"], ref["losses"])
        # The stages' memory is not the worker's: no device column, per-stage peaks in the notes.
        assert row["peak_device_gb"] is None
        assert "peak device GB per stage: s0=" in row["notes"] and " s1=" in row["notes"], row["notes"]
    assert "plan=keep" in rows["mpress"]["notes"] and "decisions s0:" not in rows["mpress"]["notes"]
    capped = rows["mpress-capped"]["notes"]
    assert "schedule=gpipe" in capped, capped
    assert "decisions s0:b0=" in capped, capped
    peaks = [float(x.split("=")[1]) for x in capped.split("per stage: ")[1].split()]
    assert max(peaks) <= CAP_GB, capped
    assert ref["losses"][-1] < ref["losses"][0]  # it trains


class _Backend:
    device_type, name, dist_backend = "cpu", "cpu", "gloo"
    caps = Capabilities(virtual_devices=True)

    def memory_cap(self, index: int):
        return None

    def device_count(self) -> int:
        return 1


def _ctx(**options) -> SystemContext:
    opts = {**get_system("mpress").options, **options}
    return SystemContext(backend=_Backend(), device_index=0, family="gpt",
                         dims=dict(layers=2, hidden=64, heads=4, vocab=256, seq=32), dtype=torch.float32, batch=4,
                         seq=32, optimizer={"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
                         options=opts)


@pytest.mark.parametrize("options, match", [
    ({"stages": 3}, "3 stages need at least 3 blocks"),
    ({"microbatches": 3}, "does not split into 3 equal micro-batches"),
    ({"stages": 2, "microbatches": 1}, "1F1B needs at least"),
    ({"schedule": "zb"}, "option 'schedule' must be one of"),
    ({"plan": "fast"}, "option 'plan' must be one of"),
    ({"stages": 0}, "'stages' must be a positive integer"),
])
def test_bad_options_fail_before_processes_start(options, match, monkeypatch):
    import torch.multiprocessing as mp

    from bench.systems import mpress as bench_system

    def no_spawn(*a, **k):
        raise AssertionError("a process was about to start")

    monkeypatch.setattr(mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match=match):
        bench_system.make(_ctx(**options))
