"""The cost model's step whose clip fires (``cost.predict_clip_fired``): every host update starts
once the coefficient lands, behind the last gradient copy, and the next forward waits for them."""
from __future__ import annotations

import dataclasses
import random

import pytest

from strategies.memferry.config import Plan, UnitPlan
from strategies.memferry.cost import Links, predict, predict_clip_fired
from strategies.memferry.scheduler import schedule
from tests.test_memferry_scheduler import _fix, random_links, random_profile
from tests.test_memferry_scheduler_accum import _held_profile

LINKS = Links(20.0, 20.0, None)


@pytest.mark.parametrize("seed", range(6))
def test_a_fired_clip_delays_only_the_host_and_never_speeds_a_step(seed):
    rng = random.Random(seed)
    prof, links = _fix(random_profile(rng, 3)), random_links(rng)
    prof = dataclasses.replace(prof, clipping=True, accumulation_steps=1)
    plan = schedule(prof, links, 1e15, 3, explain=False)
    normal, fired = predict(plan, prof, links), predict_clip_fired(plan, prof, links)
    assert fired.step_s >= normal.step_s
    assert fired.compute_s == normal.compute_s and fired.peak_bytes == normal.peak_bytes


def test_without_host_updates_a_fired_clip_costs_nothing():
    prof = _held_profile(5 * 10**6, 10**5)
    plan = Plan.from_spec("device3", 3)
    assert predict_clip_fired(plan, prof, LINKS).step_s == predict(plan, prof, LINKS).step_s


@pytest.mark.parametrize("order", ["deadline", "landing"])
def test_a_fired_clip_loses_the_host_work_that_overlapped_backward(order):
    """Three prefetched host-updated blocks whose updates (20 ms each) bound the step: normally
    the first two run beside backward (6 ms); in a fired step all three start when the
    coefficient lands (backward's end plus the last gradient copy), so the step grows by that
    overlap and the copy, no more."""
    prof = dataclasses.replace(_held_profile(5 * 10**6, 10**5), host_order=order, host_adamw_s_per_param=2e-8)
    plan = Plan.uniform(3, UnitPlan("prefetch", "prefetch"))
    normal, fired = predict(plan, prof, LINKS, 0.0), predict_clip_fired(plan, prof, LINKS, 0.0)
    assert normal.bound == fired.bound == "host optimizer"
    copy = 2 * 10**6 / (LINKS.d2h_GBps * 1e9)  # one block's bf16 gradient home
    assert 0 < fired.step_s - normal.step_s <= normal.parts["backward_s"] + copy + 1e-12
    assert fired.step_s - normal.step_s > normal.parts["backward_s"] / 2  # most of backward was overlapped


def test_a_plan_that_does_not_cover_the_profile_is_refused_as_predict_refuses_it():
    prof = _held_profile(5 * 10**6, 10**5)
    plan = Plan.from_spec("device2", 2)
    for fn in (predict, predict_clip_fired):
        with pytest.raises(ValueError, match=r"^the plan covers 2 blocks, the profile 3$"):
            fn(plan, prof, LINKS)
