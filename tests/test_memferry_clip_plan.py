"""The scheduler weighs the steps after clipped ones (``AdamW.clip_fire_rate``, ``clip_plan.py``)."""
from __future__ import annotations

import dataclasses

import pytest

from strategies.memferry.clip_plan import expected_step, fire_rate_hint, named_plans
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


@pytest.mark.parametrize("clipped, steps, planned, says", [
    (30, 50, 0.0, True),  # 60 % against none planned
    (9, 50, 0.0, False),  # 18 %: rare enough for speculation's bet
    (30, 50, 0.5, False),  # as planned, within 0.15
    (5, 50, 0.6, False),  # 10 %: fewer than planned, but rare (the plan is merely cautious)
])
def test_the_fire_rate_hint_speaks_only_when_firing_is_common_and_unplanned(clipped, steps, planned, says):
    hint = fire_rate_hint(clipped, steps, planned)
    assert (hint is not None) == says
    if says:
        assert f"fired in {clipped} of the first {steps} steps" in hint and "clip_fire_rate=0.60" in hint


def test_the_engine_hints_at_the_fire_rate_once(cpu_backend, caplog, monkeypatch):
    import torch

    from strategies.memferry import MemFerry
    from strategies.models import build_model

    monkeypatch.setattr("strategies.memferry.engine.HINT_STEP", 3)
    tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tok[:, :-1], tok[:, 1:]
    for rate, hinted in ((0.0, True), (1.0, False)):
        caplog.clear()
        torch.manual_seed(0)
        model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)  # a closed engine's model is spent
        engine = MemFerry(model, optim=AdamW(lr=1e-3, max_grad_norm=1e-6, clip_fire_rate=rate), plan="auto",
                          sample=(x, y), backend=cpu_backend, blocks=model.blocks)
        with caplog.at_level("WARNING", logger="xpu.memferry"):
            for _ in range(4):
                engine.train_step(x, y)
        assert engine.clipped_steps == 4  # a norm of 1e-6 clips every step
        engine.close()
        said = [r.getMessage() for r in caplog.records if "clip fired" in r.getMessage()]
        assert len(said) == (1 if hinted else 0), said
        if hinted:
            assert "fired in 3 of the first 3 steps" in said[0]
