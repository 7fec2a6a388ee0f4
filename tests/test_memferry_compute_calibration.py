"""The rehearsal's check of the device's compute (``compute_calibration.py``): where compute
bounds a plan and its rehearsed step ran off its price, every compute time of the profile is
scaled so the plan is priced at the rehearsed step; memory figures stay, and a host-bound plan
is left to the host's calibration.

Profiles here have fixed timings and the rehearsal's step time is set, so nothing depends on
this machine's speed."""
from __future__ import annotations

import copy
import dataclasses

import pytest

import strategies.memferry.compute_calibration as compute_calibration
import strategies.memferry.host_calibration as host_calibration
import strategies.memferry.rehearsal as rehearsal
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.compute_calibration import LIMIT, SHARE, TOLERANCE, compute_scale, scaled
from strategies.memferry.config import Plan, UnitPlan
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.pass_timing import TIME_FIELDS
from strategies.memferry.planning import plan_for
from strategies.memferry.profiler import StepProfile
from strategies.memferry.scheduler import price
from tests.rehearsal_here import rehearse_here
from tests.test_memferry_scheduler_accum import batch, qwen2_tied

def _fixed(profile: StepProfile) -> StepProfile:
    """``profile`` with fixed compute times (its bytes as measured) and a fast host: compute
    bounds its plans on any machine."""
    blocks = [dataclasses.replace(b, fwd_s=4e-3, bwd_s=8e-3, fwd_selective_s=5e-3, bwd_selective_s=1e-2,
                                  recompute_s=4e-3) for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks, eager_blocks=[dataclasses.replace(b) for b in blocks],
                               rest_fwd_s=2e-3, rest_bwd_s=3e-3, host_adamw_s_per_param=1e-12,
                               host_adamw_copies_s_per_param=1e-12, device_adamw_s_per_param=1e-12)


@pytest.fixture(scope="module")
def _planned():
    """A plan for the tiny Qwen2 without a budget on the cpu backend, made once for the module
    (profiling takes seconds), with its profile's timings fixed; and the device's links."""
    import xpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPU_BACKEND", "cpu")
        xpu.reset_backend()
        backend = xpu.get_backend()
        plan = plan_for(qwen2_tied(), batch(), None, backend=backend, memory_margin=0.0)
        links = links_from_probe(backend, 0)
        xpu.reset_backend()
    return dataclasses.replace(plan, profile=_fixed(plan.profile)), links


@pytest.fixture
def compute_bound(_planned):
    """A copy of the module's plan, whose predicted step is its compute chain; its profile and the
    device's links."""
    plan, links = _planned
    plan = copy.deepcopy(plan)
    pred = predict(plan, plan.profile, links, 0.0)
    assert pred.compute_s >= SHARE * pred.step_s
    return plan, plan.profile, links


@pytest.mark.parametrize("over", [1.25, 0.85])
def test_a_compute_bound_step_off_its_price_is_priced_at_the_rehearsed_step(compute_bound, over):
    plan, profile, links = compute_bound
    before = predict(plan, profile, links, 0.0).step_s
    scale = compute_scale(plan, profile, links, 0.0, over * before)
    assert scale is not None and (scale > 1) == (over > 1)
    after = predict(plan, scaled(profile, scale), links, 0.0)
    assert after.step_s == pytest.approx(over * before, rel=2e-3)
    assert after.peak_bytes == predict(plan, profile, links, 0.0).peak_bytes  # memory is not compute


def test_within_the_tolerance_or_untimed_the_profile_stands_and_the_scale_has_a_limit(compute_bound):
    plan, profile, links = compute_bound
    before = predict(plan, profile, links, 0.0).step_s
    assert compute_scale(plan, profile, links, 0.0, before * TOLERANCE * 0.999) is None
    assert compute_scale(plan, profile, links, 0.0, before / TOLERANCE * 1.001) is None
    assert compute_scale(plan, profile, links, 0.0, None) is None
    assert compute_scale(plan, profile, links, 0.0, 5 * before) == LIMIT
    assert compute_scale(plan, profile, links, 0.0, before / 5) == 1 / LIMIT


def test_a_host_bound_plan_is_not_scaled(compute_bound):
    plan, profile, links = compute_bound
    slow_host = dataclasses.replace(profile, host_adamw_s_per_param=1e-6, host_adamw_copies_s_per_param=1e-6)
    hosted = Plan([UnitPlan("prefetch", "prefetch", optimizer="host")] * len(profile.blocks), rest_optimizer="host")
    pred = predict(hosted, slow_host, links, 0.0)
    assert pred.compute_s < 0.5 * pred.step_s
    assert compute_scale(hosted, slow_host, links, 0.0, 2 * pred.step_s) is None


def test_scaled_multiplies_every_compute_time_keeps_the_bytes_and_survives_json(compute_bound):
    _, profile, _ = compute_bound
    twice = scaled(scaled(profile, 1.5), 1.2)
    assert twice.compute_scale == pytest.approx(1.8) and profile.compute_scale == 1.0
    for got, was in zip(twice.blocks + twice.eager_blocks, profile.blocks + profile.eager_blocks):
        for k in TIME_FIELDS:
            assert getattr(got, k) == pytest.approx(1.8 * getattr(was, k))
        assert (got.act_bytes, got.param_bytes, got.bwd_extra_bytes) == (was.act_bytes, was.param_bytes,
                                                                        was.bwd_extra_bytes)
    assert (twice.rest_fwd_s, twice.rest_bwd_s) == pytest.approx((1.8 * 2e-3, 1.8 * 3e-3))
    assert twice.loss_peak_bytes == profile.loss_peak_bytes
    assert StepProfile.from_json(twice.to_json()) == twice
    assert scaled(profile, 1.0) is profile


def test_the_rehearsal_prices_a_compute_bound_plan_at_its_rehearsed_step(cpu_backend, monkeypatch, compute_bound):
    """The whole path: a plan from a fixed-timing profile, rehearsed with its steps clocked at
    1.2x its prediction (the host's work at the plan's own rate, so the host's check finds
    nothing) comes out priced at the rehearsed step, its profile's compute scaled, its notes
    saying so beside the prediction before."""
    rehearse_here(monkeypatch)
    monkeypatch.setattr(host_calibration, "compute_scale", compute_calibration.compute_scale)  # back on
    plan, profile, links = compute_bound
    price(plan, profile, links, 0.0)
    before = plan.predicted_step_s
    monkeypatch.setattr(HostOptimizer, "split_since",
                        lambda self, start: (plan.host_s_per_param, 0.0) if self.updated_numel else None)
    real = rehearsal._rehearse

    def clocked_slow(engine, sample, timed):
        got = real(engine, sample, timed)
        return got._replace(clock=tuple(c._replace(step_s=1.2 * before) for c in got.clock))

    monkeypatch.setattr(rehearsal, "_rehearse", clocked_slow)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(),
                      device_budget=int(plan.predicted_peak_bytes * 2), backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if "the profile's compute times scaled" in n]
    assert len(said) == 1, engine.plan.notes
    assert engine.plan.profile.compute_scale > 1.1
    assert engine.plan.predicted_step_s == pytest.approx(1.2 * before, rel=5e-3)
    assert f"predicted step {before * 1e3:.1f} ->" in said[0]
    engine.close()
