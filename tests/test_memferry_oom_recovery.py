"""A step that runs out of device memory (``oom_recovery.py``): planned again with a larger margin
and run again from its first micro-batch, training on as if it had never failed; refused, with
what would work, where the step cannot be run again exactly (cpu backend; the error is injected)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from strategies.memferry import AdamW, MemFerry
from strategies.memferry.executor import Executor
from strategies.memferry.oom_recovery import StepOutOfMemoryError, replan_after_oom
from strategies.memferry.planning import plan_for
from strategies.memferry.config import Plan, UnitPlan
from strategies.training.engines import MemFerryEngine
from tests.test_memferry_scheduler_accum import batch, qwen2_tied

LRS = (1e-2, 5e-3, 2e-3)  # a schedule: the step run again keeps its own rate


def _micro():
    x, y = batch()
    half = len(x) // 2
    return [(x[:half], y[:half]), (x[half:], y[half:])]


def _engine(cpu_backend, plan, budget, compute_dtype=None):
    return MemFerry(qwen2_tied(), optim=AdamW(lr=LRS[0], weight_decay=0.1), plan=plan, sample=_micro()[0],
                    device_budget=budget, backend=cpu_backend, memory_margin=0.0, accumulation_steps=2,
                    compute_dtype=compute_dtype)


def _fail_once(monkeypatch, at_forward: int | set[int]) -> list[int]:
    """The ``at_forward``-th forward from now (each of a set's) raises CUDA's out-of-memory error once."""
    seen = []
    real = Executor.begin_forward
    at = {at_forward} if isinstance(at_forward, int) else at_forward

    def forward(self):
        seen.append(1)
        if len(seen) in at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 126.00 MiB. (injected)")
        return real(self)

    monkeypatch.setattr(Executor, "begin_forward", forward)
    return seen


@pytest.fixture
def scheduled(cpu_backend):
    """A scheduled plan for 2 micro-batches a step and a budget it fits with room to spare."""
    free = plan_for(qwen2_tied(), _micro()[0], None, backend=cpu_backend, memory_margin=0.0, accumulation_steps=2)
    return free, int(free.predicted_peak_bytes * 1.5)


def _train(engine: MemFerryEngine) -> dict:
    for lr in LRS:
        engine.set_lr(lr)
        engine.train_batch(_micro())
    return engine.state_dict()


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])  # bf16: fp32 masters, the model restored from them
def test_a_step_out_of_memory_is_planned_again_and_trains_as_if_it_had_not_failed(cpu_backend, monkeypatch,
                                                                                   scheduled, compute_dtype):
    plan, budget = scheduled
    clean = MemFerryEngine(_engine(cpu_backend, plan, budget, compute_dtype))
    want = _train(clean)
    clean.close()
    faulty = MemFerryEngine(_engine(cpu_backend, plan, budget, compute_dtype))
    held = cpu_backend.memory_cap(0)
    assert held is not None and held < budget  # rehearsed: the allocator held to the plan's prediction
    # Step 2's second micro-batch (its first backward has summed already), then the rerun's first.
    _fail_once(monkeypatch, at_forward={4, 5})
    released = []
    monkeypatch.setattr(type(cpu_backend), "release_cache", lambda self, device=None: released.append(device))
    got = _train(faulty)
    assert faulty.replans == 2 and released == [0, 0]  # each failed step's cache given back before its re-run
    said = faulty._replanning.notes
    # first the same plan with the hold lifted to the budget, then (not held any more) a new plan
    assert len(said) == 2 and all(n.startswith("out of memory in a step (CUDA out of memory") for n in said), said
    assert said[-1] in faulty.engine.plan.notes
    assert "held at the plan's predicted peak" in said[0] and "the same plan built again" in said[0]
    assert "planned again with a 5% memory margin" in said[1]
    assert faulty.engine._setup["memory_margin"] == pytest.approx(0.05)
    assert cpu_backend.memory_cap(0) == budget  # the new plan is not rehearsed: no hold below the budget
    for name, t in want["model"].items():  # bit for bit: no gradient counted twice, no moment or rate lost
        assert torch.equal(got["model"][name], t), name
    for name, st in want["optimizer"].items():
        assert got["optimizer"][name]["step"] == st["step"] == 3
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"][name][key], st[key]), f"{name} {key}"
    faulty.close()


def test_an_error_in_the_step_s_last_backward_is_not_run_again(cpu_backend, scheduled):
    plan, budget = scheduled
    engine = _engine(cpu_backend, plan, budget)
    for x, y in _micro():
        engine.backward(engine(x, y) / 2)  # the last backward has begun host updates
    before = engine.plan
    with pytest.raises(StepOutOfMemoryError, match="after host updates had begun.*memory_margin above 0.00"):
        replan_after_oom(engine, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert engine.plan is before  # nothing changed: the caller's error stands
    engine.step()
    engine.close()


def test_without_host_room_for_the_state_the_step_is_not_run_again(cpu_backend, monkeypatch, scheduled):
    import strategies.memferry.oom_recovery as oom_recovery

    plan, budget = scheduled
    engine = _engine(cpu_backend, Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident",
                                                                                    optimizer="device")]), budget)
    engine.plan = dataclasses.replace(engine.plan, profile=plan.profile)  # as if scheduled: it may be made again
    host, device = ([16 * s.unit.numel for s in engine.shadow.shadows if s.home == home] for home in ("host", "device"))
    # 4 B weights + 12 B state a parameter: one host-homed unit's at a time (the shadow frees as much
    # as it is taken out), every device-homed unit's at once (its buffers free device memory)
    need = max(host) + sum(device)
    assert len(host) == 2 and need < 16 * sum(p.numel() for p in engine.model.parameters())
    monkeypatch.setattr(oom_recovery, "mem_available", lambda: need - 1)
    before = engine.plan
    with pytest.raises(StepOutOfMemoryError, match="keeping the optimizer state through a rebuild takes"):
        replan_after_oom(engine, "CUDA out of memory")
    assert engine.plan is before
    monkeypatch.setattr(oom_recovery, "mem_available", lambda: need)
    replan_after_oom(engine, "CUDA out of memory")
    assert engine.plan is not before
    engine.close()


def test_a_given_plan_is_not_made_again(cpu_backend, scheduled):
    _, budget = scheduled
    engine = _engine(cpu_backend, Plan.from_spec("prefetch", 2), budget)
    with pytest.raises(StepOutOfMemoryError, match="given, not scheduled.*plan='auto'"):
        replan_after_oom(engine, "CUDA out of memory")
    engine.close()


def test_the_training_engine_gives_up_after_its_attempts(cpu_backend, monkeypatch, scheduled):
    import strategies.memferry.oom_recovery as oom_recovery

    plan, budget = scheduled
    monkeypatch.setattr(oom_recovery, "ATTEMPTS", 0)
    engine = MemFerryEngine(_engine(cpu_backend, plan, budget))
    _fail_once(monkeypatch, at_forward=1)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        engine.train_batch(_micro())
    assert engine.replans == 0
    engine.close()


def test_a_rebuild_keeps_every_unit_s_state_where_units_change_homes(cpu_backend, scheduled):
    """The state goes out of the shadow and back into the new one unit by unit; a unit homed on
    the host before and on the device after (and the other way round) keeps its weights, master,
    moments and step exactly."""
    from strategies.memferry.oom_recovery import rebuild_keeping_state

    _, budget = scheduled
    host_first = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device")])
    engine = _engine(cpu_backend, host_first, budget, torch.bfloat16)
    for x, y in _micro():
        engine.backward(engine(x, y) / 2)
    engine.step()
    before = engine.state_dict()
    rebuild_keeping_state(engine, Plan([UnitPlan("resident", "resident", optimizer="device"),
                                        UnitPlan("prefetch", "prefetch")]))
    assert [s.home for s in engine.shadow.shadows[:2]] == ["device", "host"]
    after = engine.state_dict()
    assert all(torch.equal(after["model"][n], t) for n, t in before["model"].items())
    for name, st in before["optimizer"].items():
        assert after["optimizer"][name]["step"] == st["step"] == 1
        assert all(torch.equal(after["optimizer"][name][k], st[k]) for k in ("master", "exp_avg", "exp_avg_sq")), name
    engine.close()


def test_a_benchmark_row_whose_step_runs_out_of_memory_is_planned_again_and_trains_on(cpu_backend, monkeypatch):
    """The benchmark's MemFerry rows step as ``xpu train`` does (``ReplanningSteps``): a timed
    step that runs out of device memory after its first forward is planned again, runs again
    from its first micro-batch, and the row's losses are the clean row's; the row says so."""
    import bench.systems.memferry as bench_memferry
    from bench.scenario import load_scenario
    from bench.systems.base import micro_batches
    from bench.worker import run_spec

    scenario = load_scenario({"model": {"family": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 128},
                              "batch": 2, "seq": 16, "steps": 2, "warmup": 1, "dtype": "fp32", "seed": 0,
                              "timeline": False, "accumulation_steps": 2,
                              "systems": [{"name": "memferry", "device_mem_gb": 1, "options": {"plan": "auto"}}]})

    def row() -> dict:
        out = run_spec({"scenario": scenario.to_dict(), "label": "memferry", "timeline_path": None}, in_process=True)
        assert out["status"] == "ok", out["reason"]
        return out

    clean = row()
    real, calls = bench_memferry.engine_step, []

    def runs_out_once(engine, inputs, targets, accumulation):
        calls.append(1)
        if len(calls) == 2:  # the first timed step: one micro-batch's forward, then the error
            engine(*micro_batches(inputs, targets, accumulation)[0])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 298.00 MiB. (injected)")
        return real(engine, inputs, targets, accumulation)

    monkeypatch.setattr(bench_memferry, "engine_step", runs_out_once)
    got = row()
    assert clean["replans"] == 0 and got["replans"] == 1
    assert got["losses"] == clean["losses"]  # the step ran again exactly: nothing counted twice
    assert "1 step(s) ran out of memory and ran again: out of memory in a step (CUDA out of memory" in got["notes"]
    # the engine was held to its plan's prediction: the same plan ran again under the budget
    assert "the same plan built again, the allocator capped at the budget, 1.0 GB" in got["notes"], got["notes"]
