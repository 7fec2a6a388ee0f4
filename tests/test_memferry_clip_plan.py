"""The scheduler weighs the steps after clipped ones (``AdamW.clip_fire_rate``, ``clip_plan.py``)."""
from __future__ import annotations

import dataclasses

import pytest

from strategies.memferry.clip_plan import expected_step, named_plans
from strategies.memferry.config import AdamW, Plan
from strategies.memferry.cost import Links, predict, predict_clip_fired
from strategies.memferry.scheduler import schedule, unit_choices
from tests.test_memferry_scheduler_accum import _held_profile

LINKS = Links(20.0, 20.0, None)


def _host_bound(n: int = 6):
    """``n`` blocks whose host updates (2 ms each) take about their compute (3 ms): the search
    overlaps them with backward, which a clip that fires undoes."""
    prof = dataclasses.replace(_held_profile(5 * 10**6, 10**5), host_order="deadline", host_adamw_s_per_param=2e-9)
    return dataclasses.replace(prof, blocks=[prof.blocks[0]] * n)


def test_a_fire_rate_picks_the_plan_of_least_expected_step():
    prof = _host_bound()
    budget = predict(Plan.from_spec("device4", 6), prof, LINKS, 0.0).peak_bytes  # room for four device-homed blocks
    plain = schedule(prof, LINKS, budget, margin=0.0, explain=False)
    rated = dataclasses.replace(prof, clip_fire_rate=1.0)
    clipped = schedule(rated, LINKS, budget, margin=0.0, explain=False)
    assert predict(clipped, prof, LINKS, 0.0).peak_bytes <= budget
    e_plain, e_clipped = (expected_step(p, prof, LINKS, 0.0, 1.0) for p in (plain, clipped))
    assert e_clipped < e_plain  # fewer host updates to wait for after a clipped step
    assert predict(plain, prof, LINKS, 0.0).step_s <= predict(clipped, prof, LINKS, 0.0).step_s
    assert any("clip firing in 100% of steps" in n and "faster when the clip does not fire" in n for n in clipped.notes)
    # no named plan that fits beats it on the expected step
    for cand in named_plans(6, unit_choices(allow_dha=False), ["host", "device"], [1, 2]):  # as schedule() offers
        if predict(cand, prof, LINKS, 0.0).peak_bytes <= budget:
            assert expected_step(cand, prof, LINKS, 0.0, 1.0) >= e_clipped - 1e-12


def test_without_a_rate_or_without_clipping_the_plan_is_the_searchs():
    prof = _host_bound()
    budget = predict(Plan.from_spec("device4", 6), prof, LINKS, 0.0).peak_bytes
    unclipped = dataclasses.replace(prof, clipping=False)
    for base in (prof, unclipped):
        plain = schedule(base, LINKS, budget, margin=0.0)
        assert not any("clip_fire_rate" in n for n in plain.notes)
        rate = 0.0 if base.clipping else 1.0  # no rate, or a rate with nothing to clip
        other = schedule(dataclasses.replace(base, clip_fire_rate=rate), LINKS, budget, margin=0.0)
        assert other.units == plain.units and other.rest_optimizer == plain.rest_optimizer
        assert other.notes == plain.notes


def test_the_expected_step_mixes_the_two_predictions():
    prof = _host_bound(3)
    plan = Plan.from_spec("prefetch", 3)
    normal, fired = predict(plan, prof, LINKS, 0.0).step_s, predict_clip_fired(plan, prof, LINKS, 0.0).step_s
    assert fired > normal
    assert expected_step(plan, prof, LINKS, 0.0, 0.25) == pytest.approx(0.75 * normal + 0.25 * fired)
    assert expected_step(plan, prof, LINKS, 0.0, 0.0) == normal


@pytest.mark.parametrize("kwargs, match", [
    ({"max_grad_norm": 1.0, "clip_fire_rate": 1.5}, r"clip_fire_rate is a share of steps, from 0 to 1; got 1.5"),
    ({"clip_fire_rate": 0.3}, r"clip_fire_rate=0.3 weighs steps whose clip fires, but max_grad_norm is None"),
])
def test_a_bad_fire_rate_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW(**kwargs)
