"""What a host-bound step runs beyond its host work, priced from the rehearsal
(``host_calibration.step_gap``, ``with_gap``; ``StepProfile.host_gap_s`` in the cost model's host
term). The cpu backend's virtual devices skip the rehearsal's host check; these tests turn it on
and set what it measures, so nothing depends on this machine's timing."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import strategies.memferry.host_calibration as host_calibration
import strategies.memferry.rehearsal as rehearsal
import strategies.memferry.rehearsal_steps as rehearsal_steps
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.config import UnitPlan
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.host_calibration import (SETTLE_TRIES, calibrated, priced_on_own_rate, repriced, step_gap,
                                                 with_gap)
from tests.test_memferry_host_calibration import _host_plan, _measuring, host_plan  # noqa: F401  (fixtures)
from tests.test_memferry_rehearsal import true_min_budget  # noqa: F401  (a fixture)
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def test_the_gap_is_the_least_of_the_clocked_steps_time_beyond_their_host_work():
    clock = [rehearsal.Clocked(1.0, 0.2, 0.9), rehearsal.Clocked(1.2, 0.3, 1.05)]
    assert step_gap(clock) == pytest.approx(0.1)  # not 0.15: a disturbance only adds
    assert step_gap(()) is None


def _host_bound(host_plan, cpu_backend):  # noqa: F811
    """``host_plan``'s plan, a profile on which the host bounds it (updates 50x their price), the
    links, and the prediction there."""
    plan, _ = host_plan
    links = links_from_probe(cpu_backend, 0)
    profile = calibrated(plan.profile, 50.0)
    pred = predict(plan, profile, links, 0.0)
    assert pred.bound == "host optimizer"
    return plan, profile, links, pred


def test_a_host_bound_step_is_priced_the_gap_its_rehearsal_measured(host_plan, cpu_backend):  # noqa: F811
    plan, profile, links, pred = _host_bound(host_plan, cpu_backend)
    priced = pred.step_s - pred.host_optimizer_s
    gapped = with_gap(plan, profile, links, 0.0, priced + 0.03)
    assert gapped.host_gap_s == pytest.approx(0.03) and profile.host_gap_s == 0.0  # the caller's kept
    again = predict(plan, gapped, links, 0.0)
    assert again.step_s == pytest.approx(pred.step_s + 0.03) and again.parts["host_gap_s"] == pytest.approx(0.03)
    assert again.peak_bytes == pred.peak_bytes and again.compute_s == pred.compute_s
    assert gapped.notes[-1].endswith("30.0 ms added to the host's term"), gapped.notes[-1]
    assert with_gap(plan, gapped, links, 0.0, priced + 0.03) is gapped  # priced already: unchanged
    # Measured again on the gapped profile, the gap is set anew, not added twice.
    assert with_gap(plan, gapped, links, 0.0, priced + 0.01).host_gap_s == pytest.approx(0.01)


def test_a_step_bound_by_the_host_s_memory_is_priced_the_gap_too(host_plan, cpu_backend, monkeypatch):  # noqa: F811
    # The 128-layer GPT's plan was bound by host memory, 7 ms over its host work's chain, and its
    # steps ran 88 ms beyond their host work (H100, session 43): the gap adds to both host terms.
    plan, profile, links, pred = _host_bound(host_plan, cpu_backend)
    assert "host memory" in pred.parts
    parts = predict(plan, dataclasses.replace(profile, host_gap_s=0.02), links, 0.0).parts
    for term in ("host optimizer", "host memory"):
        assert parts[term] == pytest.approx(pred.parts[term] + 0.02)
    memory_bound = dataclasses.replace(pred, bound="host memory", step_s=1.0, host_optimizer_s=0.99)
    monkeypatch.setattr(host_calibration, "predict", lambda *args: memory_bound)
    assert with_gap(plan, profile, links, 0.0, 0.05).host_gap_s == pytest.approx(0.04)


def test_a_gap_the_model_already_prices_or_a_step_the_host_does_not_bound_changes_nothing(
        host_plan, cpu_backend):  # noqa: F811
    plan, profile, links, pred = _host_bound(host_plan, cpu_backend)
    assert with_gap(plan, profile, links, 0.0, 0.5 * (pred.step_s - pred.host_optimizer_s)) is profile
    resident = UnitPlan("resident", "resident", optimizer="device")  # nothing updated on the host, nothing copied
    on_device = dataclasses.replace(plan, units=[resident] * len(plan.units), rest_optimizer="device")
    assert predict(on_device, profile, links, 0.0).bound == "compute"
    assert with_gap(on_device, profile, links, 0.0, 10.0) is profile


def test_the_rehearsal_s_gap_calibrates_the_plan(cpu_backend, monkeypatch, host_plan):  # noqa: F811
    plan, budget = host_plan
    _measuring(monkeypatch, 50 * plan.host_s_per_param)
    _, profile, links, pred = _host_bound(host_plan, cpu_backend)
    gap = pred.step_s - pred.host_optimizer_s + 0.05
    monkeypatch.setattr(rehearsal, "step_gap", lambda clock: gap)
    monkeypatch.setattr(host_calibration, "SEARCH_AGAIN", 1e6)  # keep the layout: the pricing is what is checked
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "50.0 ms added to the host's term" in said[0], engine.plan.notes
    assert engine.plan.profile.host_gap_s == pytest.approx(0.05)
    assert engine.plan.predicted_step_s == pytest.approx(pred.step_s + 0.05)
    engine.close()


def test_a_rehearsal_whose_host_stayed_disturbed_prices_no_gap(cpu_backend, monkeypatch, host_plan):  # noqa: F811
    plan, budget = host_plan
    _measuring(monkeypatch, 1.5 * plan.host_update_s_per_param)
    timings = iter([1.2, 1.4] * (1 + SETTLE_TRIES))  # the kernel alone: disturbed around every run
    monkeypatch.setattr(rehearsal_steps, "alone_slowdown", lambda engine: next(timings))
    asked = []
    monkeypatch.setattr(rehearsal, "step_gap", lambda clock: asked.append(clock) or 1.0)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    assert any(n.startswith("host rate:") for n in engine.plan.notes)  # calibrated on its rate...
    assert asked == [] and engine.plan.profile.host_gap_s == 0.0  # ...not on its gap
    engine.close()


def test_a_plan_kept_after_its_own_rehearsal_is_priced_on_its_own_gap(host_plan, cpu_backend):  # noqa: F811
    """A race's winner inherits the first plan's calibrated profile, gap included; its own timed
    rehearsal's gap replaces it (here, less than inherited)."""
    plan, profile, links, pred = _host_bound(host_plan, cpu_backend)
    priced = pred.step_s - pred.host_optimizer_s
    inherited = repriced(plan, dataclasses.replace(profile, host_gap_s=0.1), links, 0.0)
    engine = SimpleNamespace(plan=inherited, backend=cpu_backend, device=0)
    own = (inherited.host_update_s_per_param, inherited.host_earlier_s_per_param)  # its rates as priced
    found: list[str] = []
    priced_on_own_rate(engine, own, 0.0, found, gap_s=priced + 0.04)
    assert engine.plan.profile.host_gap_s == pytest.approx(0.04)
    assert engine.plan.predicted_step_s == pytest.approx(pred.step_s + 0.04)
    assert len(found) == 1 and "40.0 ms added to the host's term" in found[0], found
    engine.plan = inherited
    priced_on_own_rate(engine, own, 0.0, found)  # no gap measured: the inherited one stays
    assert engine.plan.profile.host_gap_s == pytest.approx(0.1) and "added" not in found[-1]
