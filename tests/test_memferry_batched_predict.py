"""Many related plans priced in one pass (``batched_predict.py``, ``named_plans.py``): each
prediction equals :func:`~strategies.memferry.cost.predict`'s to the bit."""
from __future__ import annotations

import dataclasses

import pytest

from strategies.memferry.config import Plan, UnitPlan
from strategies.memferry.cost import predict
from strategies.memferry.batched_predict import one_block_changes, split_predictions
from strategies.memferry.named_plans import named_plans, named_predictions
from strategies.memferry.scheduler import schedule, unit_choices
from tests.test_memferry_scheduler import H200_LINKS, h200_profile


def _uneven(profile, **changes):
    """``profile`` with blocks of three sizes and speeds (the largest prefetched block sets the
    slot), and ``changes``."""
    blocks = [dataclasses.replace(b, numel=b.numel * f, param_bytes=b.param_bytes * f, fwd_s=b.fwd_s * f,
                                  bwd_s=b.bwd_s * f, act_bytes=b.act_bytes * f)
              for b, f in zip(profile.blocks, [1, 2, 3] * len(profile.blocks))]
    return dataclasses.replace(profile, blocks=blocks, **changes)


PROFILES = {
    "h200": h200_profile(),
    "uneven, deadline order, host-memory model": _uneven(
        h200_profile(), host_order="deadline", host_adamw_s_per_param=0.264e-9, host_adamw_copies_s_per_param=0.314e-9,
        host_copies_GBps=56.3, host_adamw_bytes_per_param=28),
    "uneven, accumulation 4": _uneven(h200_profile(), accumulation_steps=4),
}


@pytest.mark.parametrize("name", PROFILES)
def test_every_named_plan_is_priced_as_predict_prices_it(name):
    profile = PROFILES[name]
    links = dataclasses.replace(H200_LINKS, host_GBps=88.2, host_copy_weight=0.3) if "host-memory" in name else H200_LINKS
    choices = unit_choices(allow_dha=True, device_sum=profile.accumulation_steps > 1)
    got = named_predictions(profile, links, 0.05, choices, ["host", "device"], [1, 2])
    plans = list(named_plans(len(profile.blocks), choices, ["host", "device"], [1, 2]))
    assert [p.units for p, _ in got] == [p.units for p in plans] and len(got) > 4 * len(profile.blocks)
    for plan, pred in got:
        want = predict(plan, profile, links, 0.05)
        assert (pred.step_s, pred.peak_bytes, pred.compute_s, pred.bound) == (
            want.step_s, want.peak_bytes, want.compute_s, want.bound), (plan.describe(), pred, want)


def test_any_two_units_split_at_every_block():
    """A pair no name gives (DHA blocks above offloading ones), at every split."""
    profile = _uneven(h200_profile())
    head, tail = UnitPlan("dha", "dha", recompute=True), UnitPlan("prefetch", "prefetch", offload=True)
    n = len(profile.blocks)
    preds = split_predictions(head, tail, profile, H200_LINKS, "host", 2, 0.1)
    assert len(preds) == n + 1
    for k, pred in enumerate(preds):
        want = predict(Plan([head] * k + [tail] * (n - k), 2, "host"), profile, H200_LINKS, 0.1)
        assert (pred.step_s, pred.peak_bytes) == (want.step_s, want.peak_bytes), k
    assert len({p.step_s for p in preds}) > 2  # the splits differ: the test could tell them apart


# The prefetch depth each profile's full search picks (rest updated on the device in all three):
# searched at that depth alone, the plan is the same, in a fifth of the time.
SEARCHED_DEPTH = {"h200": 1, "uneven, deadline order, host-memory model": 2, "uneven, accumulation 4": 1}


@pytest.mark.parametrize("name", PROFILES)
def test_every_one_block_change_of_a_searched_plan(name):
    """The scheduler's note of each block's best alternative prices every one-block change."""
    profile = PROFILES[name]
    links = dataclasses.replace(H200_LINKS, host_GBps=88.2, host_copy_weight=0.3) if "host-memory" in name else H200_LINKS
    plan = schedule(profile, links, 40e9, margin=0.05, explain=False, depths=(SEARCHED_DEPTH[name],),
                    rest_optimizers=("device",))
    assert plan.prefetch_depth == SEARCHED_DEPTH[name] and plan.rest_optimizer == "device"
    assert len(set(plan.units)) > 1  # a mixed plan: changes above, at and below each kind of block
    choices = unit_choices(allow_dha=True, device_sum=profile.accumulation_steps > 1)
    got = one_block_changes(plan, profile, links, 0.05, choices)
    n = len(plan.units)
    assert len(got) == sum(c != u for u in plan.units for c in choices)
    for (i, c), pred in got.items():
        trial = Plan(list(plan.units), plan.prefetch_depth, plan.rest_optimizer)
        trial.units[i] = c
        want = predict(trial, profile, links, 0.05)
        assert (pred.step_s, pred.peak_bytes) == (want.step_s, want.peak_bytes), (i, c)
    assert {i for i, _ in got} == set(range(n))
