"""The rehearsal step's host-rate check (``host_calibration.py``): where the step's host updates
ran far off the rate the plan assumed, the scheduler plans again from the profile calibrated to
the measured rate, and a plan of another layout is built and rehearsed in its turn; within the
tolerance the plan stays as it was.

The cpu backend's virtual devices skip the check (``host_calibration.applies``); these tests
turn it on and set the measured rate, so nothing depends on this machine's timing."""
from __future__ import annotations

import pytest

import strategies.memferry.rehearsal as rehearsal
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.config import Plan
from strategies.memferry.host_calibration import TOLERANCE, same_layout
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.planning import plan_for
from tests.test_memferry_rehearsal import true_min_budget  # noqa: F401  (a fixture)
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def _measuring(monkeypatch, rate: float) -> None:
    """Host updates report ``rate`` seconds per parameter, and the check runs on the cpu backend."""
    monkeypatch.setattr(rehearsal, "applies", lambda backend: True)
    monkeypatch.setattr(HostOptimizer, "measured_s_per_param", lambda self: rate if self.updated_numel else None)


@pytest.fixture
def host_plan(cpu_backend, true_min_budget):  # noqa: F811
    """A scheduled plan with host-updated blocks, and its budget."""
    budget = int(true_min_budget * 1.1)
    plan = plan_for(qwen2_tied(), batch(), budget, backend=cpu_backend, memory_margin=0.0)
    assert any(u.optimizer == "host" for u in plan.units) or plan.rest_optimizer == "host"
    return plan, budget


def test_a_host_rate_far_off_the_plan_is_calibrated_and_planned_again(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, 3 * plan.host_s_per_param)
    x, y = batch()
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "3.00x" in said[0] and "scaled by 3.00" in said[0], engine.plan.notes
    assert engine.plan.profile.host_adamw_s_per_param == pytest.approx(3 * plan.profile.host_adamw_s_per_param)
    assert plan.profile.host_adamw_s_per_param != engine.plan.profile.host_adamw_s_per_param  # the caller's kept
    assert engine.plan.host_s_per_param > 1.5 * plan.host_s_per_param  # the new prediction prices the slower host
    assert engine.plan.predicted_step_s >= plan.predicted_step_s
    assert ("same plan" in said[0]) == same_layout(engine.plan, plan)
    assert sum(n.startswith("rehearsal:") for n in engine.plan.notes) == 1
    assert engine.optimizer.updated_numel == 0  # the rehearsal's counts are gone, as if just built
    assert float(engine.train_step(x, y)) > 0
    engine.close()


def test_a_host_rate_within_the_tolerance_keeps_the_plan(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, plan.host_s_per_param * (TOLERANCE - 0.05))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "plan kept" in said[0]
    assert same_layout(engine.plan, plan) and engine.plan.predicted_step_s == plan.predicted_step_s
    assert engine.plan.profile is plan.profile
    engine.close()


def test_a_calibrated_plan_of_another_layout_is_built_and_rehearsed(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, 3 * plan.host_s_per_param)
    other = Plan.from_spec("prefetch+recompute", len(plan.units))
    assert not same_layout(other, plan)
    other.profile, other.predicted_step_s, other.predicted_peak_bytes = plan.profile, 1.0, plan.predicted_peak_bytes
    calls = []
    real = rehearsal.replan

    def replan(*args, **kwargs):
        calls.append(kwargs.get("profile"))
        return other if kwargs.get("profile") is not None else real(*args, **kwargs)

    monkeypatch.setattr(rehearsal, "replan", replan)
    x, y = batch()
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    assert len(calls) == 1  # calibrated once: the second plan's rehearsal checks memory only
    assert same_layout(engine.plan, other) and engine.executor.plan is engine.plan
    notes = engine.plan.notes
    assert any("a different plan" in n for n in notes) and sum(n.startswith("rehearsal:") for n in notes) == 1
    assert all(u.forward == "prefetch" for u in engine.executor.plan.units)
    assert float(engine.train_step(x, y)) > 0
    engine.close()
