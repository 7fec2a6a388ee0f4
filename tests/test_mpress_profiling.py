"""MPress profiling (cpu backend, gloo).

Stages that do not fit their device with every activation kept: the profiled iteration
host-swaps every block instead, its saved-tensor hooks still record each block's sizes, the
all-keep peak is estimated, and the planner plans from that.

The memory profiler: every saved tensor's size, producer, consumer and lifetime, per stage,
with each stage's peak and its device's spare memory, in the profile the planner sees, in
the plan printout, and as JSON from ``xpu mpress --profile-json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import xpu
from strategies.models import build_model
from strategies.mpress import StageExecutor
from strategies.mpress.ipc import export_buffer, import_buffer, unlink_buffer
from strategies.mpress.memory_profile import PROFILE_FORMAT, dump_profiles, format_profile, load_profiles
from strategies.mpress.pipeline import PipelineJob, launch
from strategies.mpress.planner import Plan, format_plan
from strategies.mpress.stages import lm_loss, split_model
from test_mpress_pipeline import _assert_matches

ROOT = Path(__file__).resolve().parent.parent
DIMS = dict(layers=4, hidden=32, heads=2, vocab=64, seq=32)
ENV = {"XPU_BACKEND": "cpu", "XPU_CPU_DEVICES": "4", "XPU_CPU_DEVICE_MEM": "64MB", "XPU_COLLECTIVE_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
def profiled():
    """One pipeline launch, three profiled 2-stage jobs: 1F1B (``auto``: kept), 1F1B host-swapped, GPipe kept."""
    jobs = [PipelineJob(DIMS, schedule="1f1b", microbatches=4, batch=8, steps=1, profile=True, profile_mode="auto"),
            PipelineJob(DIMS, schedule="1f1b", microbatches=4, batch=8, steps=1, profile=True, profile_mode="host"),
            PipelineJob(DIMS, schedule="gpipe", microbatches=4, batch=8, steps=1, profile=True, profile_mode="keep")]
    return launch(jobs, 2, env=ENV)


def test_stage_that_does_not_fit_all_kept_is_profiled_swapped_and_planned(profiled):
    # 1. On roomy devices: the all-keep profile (what `auto` picks when it fits) and a forced
    #    host-swapped one of the same model see the same saved-tensor sizes.
    results = profiled
    keep0, host0 = results[0][0]["profile"], results[1][0]["profile"]
    assert keep0.mode == "keep" and results[0][0]["profile_choice"]["mode"] == "keep"
    assert host0.mode == "host"
    assert [(b.index, b.saved_bytes, b.tensors, b.input_bytes) for b in host0.blocks] == \
        [(b.index, b.saved_bytes, b.tensors, b.input_bytes) for b in keep0.blocks]
    assert keep0.inflight == host0.inflight == 2 and keep0.blocks[0].saved_bytes > 0
    # Swapped, the iteration really held less; the estimate of the all-keep peak errs high, not low.
    assert host0.measured_peak_bytes < keep0.peak_bytes <= host0.peak_bytes

    # 2. Device 0 smaller than stage 0's all-keep peak (the profile above would run out of
    #    memory on it), and a budget smaller still: profiling must swap, then the planner plan.
    in_flight = keep0.inflight * sum(b.saved_bytes for b in keep0.blocks)
    capacity0 = keep0.peak_bytes - in_flight // 8
    budget0 = keep0.peak_bytes - in_flight // 4
    assert host0.measured_peak_bytes < budget0 < capacity0 < keep0.peak_bytes
    small = dict(ENV, XPU_CPU_DEVICE_MEM=f"{capacity0},64MB,64MB,64MB")
    auto = PipelineJob(DIMS, schedule="1f1b", microbatches=4, batch=8, steps=2, lr=0.1, plan="auto",
                       budgets={0: budget0, 1: "64MB"})
    results = launch([auto], 2, env=small)[0]
    _assert_matches(auto, results)
    r0, r1 = results
    p0 = r0["profile"]
    print(r0["plan_text"])
    assert r0["profile_choice"]["mode"] == "host" and r0["profile_choice"]["keep_peak_bound"] > capacity0
    assert p0.mode == "host" and p0.measured_peak_bytes <= capacity0 < p0.peak_bytes
    assert r1["profile"].mode == "keep"  # the roomy stage is still profiled exactly
    assert "all-keep estimate: profiled with host swap" in r0["plan_text"]
    # The profile the planner saw: stage 0 over its budget all kept, stage 1 with room to spare.
    assert p0.budget_bytes == budget0 and p0.spare_bytes < 0 and r1["profile"].spare_bytes > 0
    assert "stage 0 (device 0, profiled host)" in r0["plan_text"] and "(over)" in r0["plan_text"]
    assert r0["decisions"] and set(r0["decisions"].values()) != {"keep"}
    assert r0["cap"] == budget0 and r0["peak"] <= budget0  # trained under the budget, below the all-keep peak
    moved = sum(v for k, v in r0["stats"]["bytes"].items() if k != "keep")
    assert moved > 0 or r0["stats"]["recompute_reruns"] > 0


# ---------------------------------------------------------------------------------- the memory profiler
def _per_block_mb(profile):
    """(block, micro-batch) -> its tensor records."""
    out = {}
    for t in profile.saved:
        out.setdefault((t.block, t.microbatch), []).append(t)
    return out


def _check_records_add_up(profile):
    groups = _per_block_mb(profile)
    assert {mb for _, mb in groups} == set(range(profile.microbatches))
    for b in profile.blocks:
        for mb in range(profile.microbatches):
            recs = groups[(b.index, mb)]
            # Every saved tensor the block profile counts has a record, and nothing else does.
            assert sum(t.nbytes for t in recs) == b.saved_bytes and len(recs) == b.tensors, (b, mb)
            assert [t.index for t in recs] == list(range(len(recs)))


def test_saved_tensors_are_recorded_with_producer_consumer_and_lifetime(profiled, tmp_path):
    keep_1f1b, host_1f1b, keep_gpipe = ([r["profile"] for r in job] for job in profiled)
    for profiles in (keep_1f1b, keep_gpipe):
        for p in profiles:
            assert p.mode == "keep" and p.saved
            _check_records_add_up(p)
            for t in p.saved:
                assert t.nbytes >= 1024 and t.nbytes == torch.Size(t.shape).numel() * 4 and t.dtype == "float32"
                assert t.producer and t.consumer.endswith("Backward0"), t  # every tensor was read by a named node
                assert t.where == "keep" and t.fetch_s is None
                assert 0 <= t.pack_s < t.unpack_s and t.lifetime_s == t.resident_s > 0
            producers = {t.producer for t in p.saved}
            consumers = {t.consumer for t in p.saved}
            assert {"Addmm", "Gelu", "NativeLayerNorm"} <= producers, producers
            assert {"AddmmBackward0", "GeluBackward0", "NativeLayerNormBackward0"} <= consumers, consumers
            # Views are named by the op that owns their memory, not by the view.
            assert not producers & {"View", "Transpose", "UnsafeView"}
            assert p.budget_bytes == 64_000_000 and p.spare_bytes == p.budget_bytes - p.peak_bytes > 0
            assert p.measured_peak == p.peak_bytes > 0
        # The first stage's input comes from the embedding; a later stage's is a received leaf.
        assert {t.producer for t in profiles[0].saved if t.block == 0 and t.index == 0} == {"Embedding"}
        assert {t.producer for t in profiles[1].saved if t.block == 2 and t.index == 0} == {"leaf"}

        # What any schedule guarantees, micro-batch by micro-batch: forward runs a stage's blocks
        # in order and backward in reverse, and a stage's forward (backward) of a micro-batch
        # comes before (after) the next stage's. So every tensor of block i is saved before and
        # read after every tensor of block i+1, and every tensor of stage 0 outlives every
        # tensor of stage 1 (one clock for both processes): the first block's live longest.
        for p in profiles:
            groups = _per_block_mb(p)
            for mb in range(p.microbatches):
                for a, b in zip(p.blocks, p.blocks[1:]):
                    early, late = groups[(a.index, mb)], groups[(b.index, mb)]
                    assert max(t.pack_s for t in early) < min(t.pack_s for t in late)
                    assert min(t.unpack_s for t in early) > max(t.unpack_s for t in late)
                    assert min(t.lifetime_s for t in early) > max(t.lifetime_s for t in late)
        first, second = profiles
        for mb in range(first.microbatches):
            outer = [t for t in first.saved if t.microbatch == mb]
            inner = [t for t in second.saved if t.microbatch == mb]
            assert first.clock_s + max(t.pack_s for t in outer) < second.clock_s + min(t.pack_s for t in inner)
            assert first.clock_s + min(t.unpack_s for t in outer) > second.clock_s + max(t.unpack_s for t in inner)
            longest = max(outer + inner, key=lambda t: t.lifetime_s)
            assert longest.block == first.blocks[0].index, longest
        assert first.summary()["lifetime_median_s"] > second.summary()["lifetime_median_s"]

    # Profiled host-swapped: the same tensors, now with where they went and when they came back.
    for p, kept in zip(host_1f1b, keep_1f1b):
        _check_records_add_up(p)
        assert [(t.block, t.microbatch, t.nbytes, t.producer, t.consumer) for t in p.saved] == \
            [(t.block, t.microbatch, t.nbytes, t.producer, t.consumer) for t in kept.saved]
        wheres = {t.where for t in p.saved}
        assert "host" in wheres and wheres <= {"host", "keep"}  # q/k/v views are not dense: the swapper keeps them
        for t in p.saved:
            if t.where == "host":
                assert t.pack_s < t.fetch_s <= t.unpack_s and t.resident_s < t.lifetime_s

    # The summary the plan printout shows, and the JSON dump round trip.
    line = format_profile(keep_1f1b[0])
    assert line.startswith("stage 0 (device 0, profiled keep): peak ") and "spare" in line, line
    assert "tensors" in line and "top producers Addmm" in line and "lifetime median" in line, line
    plan_text = profiled[0][0]["plan_text"]
    assert "stage 0 (device 0, profiled keep)" in plan_text and "stage 1 (device 1, profiled keep)" in plan_text
    path = dump_profiles(keep_1f1b + [None], tmp_path / "profile.json", name="unit", schedule="1f1b")
    doc = json.loads(path.read_text())
    assert doc["format"] == PROFILE_FORMAT and doc["name"] == "unit" and len(doc["stages"]) == 2
    s0 = doc["stages"][0]
    assert s0["summary"]["tensors"] == len(keep_1f1b[0].saved) and s0["summary"]["top_producers"][0][0] == "Addmm"
    assert s0["saved"][0]["consumer"] and s0["summary"]["spare_bytes"] == keep_1f1b[0].spare_bytes
    assert load_profiles(path) == keep_1f1b
    with pytest.raises(ValueError, match="not an MPress profile"):
        (tmp_path / "other.json").write_text("{}")
        load_profiles(tmp_path / "other.json")


def test_executor_traces_each_decision_and_nothing_outside_profiling(cpu_backend):
    b = cpu_backend
    torch.manual_seed(0)
    stage = split_model(build_model("gpt", **DIMS), 1)[0]
    with b.device_scope(0):
        for p in stage.parameters():
            p.data = b.to_device(p.data, 0)
    idx = torch.randint(64, (4, 32), generator=torch.Generator().manual_seed(1))
    pool, handle = export_buffer(b, 4 << 20, 1)
    try:
        region = import_buffer(b, handle)
        ex = StageExecutor(b, 0, {0: "host", 1: "recompute", 2: "peer:1"}, params=list(stage.parameters()),
                           peer_regions={1: region})
        stage.executor = ex

        def step():
            with b.device_scope(0):
                lm_loss(stage(idx), idx.roll(1, 1)).backward()

        step()  # not profiling: nothing recorded, no per-tensor work
        assert not ex.records
        plain = {n: p.grad.clone() for n, p in stage.named_parameters()}
        stage.zero_grad(set_to_none=True)
        ex.profiling = True
        ex.restart_clock()
        step()
        for n, p in stage.named_parameters():  # tracing changes no arithmetic
            torch.testing.assert_close(p.grad, plain[n], atol=0, rtol=0, msg=n)
        ex.profiling = False
        step()
        assert all(len(recs) == 1 for recs in ex.records.values()) and sorted(ex.records) == [0, 1, 2, 3]
        by_block = {i: recs[0] for i, recs in ex.records.items()}
        for i, rec in by_block.items():
            assert rec.saved and sum(t.nbytes for t in rec.saved) == rec.saved_bytes and len(rec.saved) == rec.tensors
            for t in rec.saved:
                assert t.consumer.endswith("Backward0") and 0 <= t.pack_s < t.unpack_s, t
        wheres = {i: {t.where for t in rec.saved} for i, rec in by_block.items()}
        # (q, k and v, slices of one qkv output, go out with their storage: none kept)
        assert wheres == {0: {"host"}, 1: {"recompute"}, 2: {"peer:1"}, 3: {"keep"}}, wheres
        for t in by_block[1].saved:  # re-created by the recomputation in backward, just before use
            assert t.pack_s < t.fetch_s <= t.unpack_s
            assert t.resident_s < t.lifetime_s
        for t in by_block[0].saved + by_block[2].saved:
            if t.where != "keep":
                assert t.pack_s < t.fetch_s <= t.unpack_s
        # Recomputed blocks now count what they would save (the same as a kept block of this shape).
        assert by_block[1].saved_bytes == by_block[3].saved_bytes > 0

        # trace_tensors off: per-block sums only.
        ex.trace_tensors = False
        ex.profiling = True
        step()
        assert all(len(recs) == 2 and recs[1].saved == [] for recs in ex.records.values())
        assert all(recs[1].saved_bytes == recs[0].saved_bytes for recs in ex.records.values())
    finally:
        unlink_buffer(b, handle)


# ---------------------------------------------------------------------------------- xpu mpress --profile-json
MICRO = {
    "name": "micro",
    "model": {"family": "gpt", "layers": 4, "hidden": 32, "heads": 2, "vocab": 64},
    "strategy": {"name": "mpress", "options": {"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "keep"}},
    "optimizer": {"lr": 1.0e-2, "schedule": "constant"},
    "steps": 1, "batch": 8, "seq": 16, "log_every": 1,
    "data": {"kind": "synthetic", "branching": 4},
}


def test_profile_json_is_checked_and_passed_to_the_ranks(tmp_path, capsys, monkeypatch):
    from xpu.cli import main

    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XPU_BACKEND", "cpu")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"a process was started: {a}"))
    xpu.reset_backend()
    cfg = tmp_path / "micro.yaml"
    cfg.write_text(yaml.safe_dump(MICRO))
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["mpress", str(cfg), "--profile-json", "prof.json", "--dry-run"]) == 0
        assert capsys.readouterr().out.strip().endswith(f"--profile-json {tmp_path / 'prof.json'}")
        assert main(["mpress", str(cfg), "--profile-json", str(tmp_path / "no" / "prof.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("xpu mpress: error: --profile-json") and "no directory" in err, err
    finally:
        xpu.reset_backend()


def test_profile_json_through_torchrun(tmp_path):
    cfg = tmp_path / "micro.yaml"
    cfg.write_text(yaml.safe_dump(MICRO))
    out = tmp_path / "prof.json"
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT), XPU_COLLECTIVE_TIMEOUT_S="60")
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "xpu", "mpress", str(cfg), "--profile-json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # `plan: keep` needs no profile; --profile-json takes one all the same, and rank 0 summarizes it.
    assert "profiled: stage 0 keep, stage 1 keep" in proc.stdout, proc.stdout
    for s in (0, 1):
        assert f"  stage {s} (device {s}, profiled keep): peak " in proc.stdout and "top producers" in proc.stdout
    assert f"written to {out}" in proc.stdout
    profiles = load_profiles(out)
    assert [p.stage for p in profiles] == [0, 1]
    for p in profiles:
        _check_records_add_up(p)
        assert all(t.consumer and t.lifetime_s > 0 for t in p.saved)
        assert p.budget_bytes and p.spare_bytes > 0
    assert format_plan(Plan.forced({}), profiles).count("profile: stage") == 2

