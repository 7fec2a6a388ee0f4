"""The rehearsal's host-rate check (``host_calibration.py``): the plan is priced again on the
profile calibrated to the measured ratios of the step's host updates and of the sums of its
earlier micro-batches; where either ran far off what the plan assumed and that moves its step (the
host bounds it) the scheduler searches again, and a faster plan of another layout is built and
rehearsed in its turn; within the tolerance the layout stays, priced on the measured rates.

The cpu backend's virtual devices skip the check (``host_calibration.applies``); these tests
turn it on and set the measured rate, so nothing depends on this machine's timing."""
from __future__ import annotations

import copy
import dataclasses

import pytest

import strategies.memferry.host_calibration as host_calibration
import strategies.memferry.profiler as profiler
import strategies.memferry.rehearsal_steps as rehearsal_steps
import strategies.memferry.sum_placement as sum_placement
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.config import Plan
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.host_calibration import (CEILING, DISTURBED, SETTLE_TRIES, TOLERANCE, calibrated,
                                                 ceiling_note, ratios, repriced, same_layout, undisturbed, with_sends)
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.planning import plan_for
from strategies.memferry.scheduler import min_budget
from tests.rehearsal_here import rehearse_here
from tests.test_memferry_rehearsal import true_min_budget  # noqa: F401  (a fixture)
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def _measuring(monkeypatch, update: float, earlier: float = 0.0) -> None:
    """Host updates report ``update`` seconds per parameter, and the earlier micro-batches' sums
    ``earlier``; the check runs on the cpu backend (and no device-summing rival is rehearsed:
    ``sum_placement.py`` would compare this machine's step times)."""
    rehearse_here(monkeypatch)
    monkeypatch.setattr(sum_placement, "WINDOW", -1.0)
    monkeypatch.setattr(HostOptimizer, "split_since",
                        lambda self, start: (update, earlier) if self.updated_numel else None)


def _fixed_timings(profile):
    """``profile`` with every measured time replaced by a fixed one (its bytes as measured): the
    plan made from it does not depend on how busy this machine was while it was profiled."""
    blocks = [dataclasses.replace(b, fwd_s=1e-3, bwd_s=2e-3, fwd_selective_s=1e-3, bwd_selective_s=3e-3, recompute_s=1e-3)
              for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks, rest_fwd_s=1e-3, rest_bwd_s=2e-3, host_adamw_s_per_param=1e-9,
                               host_adamw_copies_s_per_param=1.5e-9, device_adamw_s_per_param=1e-11)


def _scheduled(budget_of, **kw):
    """A plan scheduled on the cpu backend from a profile with fixed timings (the same on any
    machine under any load) under ``budget_of(backend)``, and that budget."""
    import xpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPU_BACKEND", "cpu")
        xpu.reset_backend()
        backend = xpu.get_backend()
        real = profiler.profile_step
        mp.setattr(profiler, "profile_step", lambda *a, **k: _fixed_timings(real(*a, **k)))
        budget = budget_of(backend)
        plan = plan_for(qwen2_tied(), batch(), budget, backend=backend, memory_margin=0.0, **kw)
        xpu.reset_backend()
    return plan, budget


@pytest.fixture(scope="module")
def _host_plan(true_min_budget):  # noqa: F811
    # made once for the module (profiling and searching): each test gets its own copy
    plan, budget = _scheduled(lambda backend: int(true_min_budget * 1.1))
    assert any(u.optimizer == "host" for u in plan.units) or plan.rest_optimizer == "host"
    return plan, budget


@pytest.fixture
def host_plan(_host_plan):
    """A scheduled plan with host-updated blocks, and its budget (timings fixed: the plan is the
    same on any machine under any load); a copy, as no test may see another's changes."""
    return copy.deepcopy(_host_plan)


def test_a_host_rate_far_off_the_plan_is_calibrated_and_planned_again(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, 50 * plan.host_s_per_param)  # 50x: the host bounds any plan with host updates
    x, y = batch()
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "50.00x the" in said[0] and "updates 50.00x" in said[0], engine.plan.notes
    assert "searched again" in said[0]
    assert engine.plan.profile.host_update_scale == pytest.approx(50) and engine.plan.profile.host_earlier_scale == 1
    assert plan.profile.host_update_scale == 1  # the caller's kept
    assert engine.plan.host_s_per_param > 5 * plan.host_s_per_param  # the new prediction prices the slower host
    assert engine.plan.predicted_step_s > plan.predicted_step_s
    assert sum(n.startswith("rehearsal:") for n in engine.plan.notes) == 1
    assert engine.optimizer.updated_numel == 0  # the rehearsal's counts are gone, as if just built
    assert float(engine.train_step(x, y)) > 0
    engine.close()


def test_a_plan_the_host_does_not_bound_is_repriced_not_searched(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, 2 * plan.host_s_per_param)
    real = host_calibration.repriced

    def compute_bound(p, profile, links, margin):  # as if the device bounded the step: it does not move
        out = real(p, profile, links, margin)
        out.predicted_step_s = p.predicted_step_s
        return out

    def no_search(*args, **kwargs):
        raise AssertionError("searched again for a plan whose step the host does not bound")

    monkeypatch.setattr(host_calibration, "repriced", compute_bound)
    monkeypatch.setattr(host_calibration, "replan", no_search)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "not searched again" in said[0], engine.plan.notes
    assert same_layout(engine.plan, plan)
    assert engine.plan.profile.host_update_scale == pytest.approx(2)
    assert engine.plan.host_s_per_param > plan.host_s_per_param
    engine.close()


def test_repricing_keeps_the_layout_and_predicts_on_the_new_profile(host_plan, cpu_backend):
    plan, _ = host_plan
    links = links_from_probe(cpu_backend, 0)
    slow = calibrated(plan.profile, 4.0)
    again = repriced(plan, slow, links, 0.0)
    pred = predict(plan, slow, links, 0.0)
    assert same_layout(again, plan) and again.profile is slow and again is not plan
    assert (again.predicted_step_s, again.predicted_peak_bytes) == (pred.step_s, int(pred.peak_bytes))
    assert again.predicted_peak_bytes == plan.predicted_peak_bytes  # the host rate moves no device byte
    assert again.host_s_per_param > plan.host_s_per_param and plan.profile.host_update_scale == 1
    assert slow.host_update_scale == 4 and slow.notes[-1].startswith("host work scaled to the rehearsal's: updates 4.00x")


def test_a_host_rate_within_the_tolerance_keeps_the_layout_and_predicts_on_the_measured_rate(
        cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, plan.host_s_per_param * (TOLERANCE - 0.05))

    def no_search(*args, **kwargs):
        raise AssertionError("searched again for a host rate within the tolerance")

    monkeypatch.setattr(host_calibration, "replan", no_search)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "within the tolerance: same plan, not searched again" in said[0], said
    assert same_layout(engine.plan, plan)
    assert engine.plan.profile.host_update_scale == pytest.approx(TOLERANCE - 0.05)
    links = links_from_probe(cpu_backend, 0)
    expected = predict(plan, calibrated(plan.profile, TOLERANCE - 0.05), links, 0.0)
    assert engine.plan.predicted_step_s == pytest.approx(expected.step_s)
    assert engine.plan.host_s_per_param > plan.host_s_per_param
    assert engine.plan.predicted_peak_bytes == plan.predicted_peak_bytes
    engine.close()


def test_a_calibrated_plan_of_another_layout_is_built_and_rehearsed(cpu_backend, monkeypatch, host_plan):
    plan, budget = host_plan
    _measuring(monkeypatch, 50 * plan.host_s_per_param)
    other = Plan.from_spec("prefetch+recompute", len(plan.units))
    assert not same_layout(other, plan)
    # predicted far faster than the old layout at the calibrated rate: worth building
    other.profile, other.predicted_step_s, other.predicted_peak_bytes = plan.profile, 1e-9, plan.predicted_peak_bytes
    calls = []
    real = host_calibration.replan

    def replan(*args, **kwargs):
        calls.append(kwargs.get("profile"))
        return other if kwargs.get("profile") is not None else real(*args, **kwargs)

    monkeypatch.setattr(host_calibration, "replan", replan)
    x, y = batch()
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    assert len(calls) == 1  # calibrated once: the second plan's rehearsal checks memory only
    assert same_layout(engine.plan, other) and engine.executor.plan is engine.plan
    notes = engine.plan.notes
    assert any("a faster plan" in n for n in notes) and sum(n.startswith("rehearsal:") for n in notes) == 1
    assert all(u.forward == "prefetch" for u in engine.executor.plan.units)
    assert float(engine.train_step(x, y)) > 0
    engine.close()


@pytest.fixture(scope="module")
def _accumulating_plan():
    def budget(backend):
        free = plan_for(qwen2_tied(), batch(), None, backend=backend, memory_margin=0.0, accumulation_steps=4)
        return int(min_budget(free.profile, links_from_probe(backend, 0), margin=0.0) * 1.1)

    plan, budget = _scheduled(budget, accumulation_steps=4)
    assert 0 < plan.host_earlier_s_per_param < plan.host_s_per_param
    return plan, budget


@pytest.fixture
def accumulating_plan(_accumulating_plan):
    """A scheduled plan of 4 micro-batches per step with host-updated blocks, and its budget
    (timings fixed, as :func:`host_plan`'s); a copy, made once for the module."""
    return copy.deepcopy(_accumulating_plan)


def test_calibrating_one_part_moves_only_that_part_of_the_plan_s_host_work(accumulating_plan, cpu_backend):
    plan, _ = accumulating_plan
    links = links_from_probe(cpu_backend, 0)
    earlier = plan.host_earlier_s_per_param
    update = plan.host_s_per_param - earlier
    assert ratios(plan, (1.5 * update, 0.5 * earlier)) == pytest.approx((1.5, 0.5))
    # a plan that prices no sums apart (no host-memory model) compares all host work with its updates
    unsplit = dataclasses.replace(plan, host_s_per_param=update, host_earlier_s_per_param=0.0)
    assert ratios(unsplit, (1.5 * update, 0.5 * update)) == pytest.approx((2.0, 1.0))
    slow = repriced(plan, calibrated(plan.profile, 1.5), links, 0.0)
    assert slow.host_earlier_s_per_param == pytest.approx(earlier)
    assert slow.host_s_per_param - slow.host_earlier_s_per_param > 1.2 * update
    fast = repriced(plan, calibrated(plan.profile, 1.0, 0.5), links, 0.0)
    assert fast.host_s_per_param - fast.host_earlier_s_per_param == pytest.approx(update)
    assert fast.host_earlier_s_per_param < 0.8 * earlier


def test_parts_off_in_opposite_ways_are_calibrated_though_their_total_is_not(cpu_backend, monkeypatch,
                                                                             accumulating_plan):
    plan, budget = accumulating_plan
    earlier = plan.host_earlier_s_per_param
    update = plan.host_s_per_param - earlier
    slower = min(1.5, 1 + 0.5 * earlier / update)  # the update slower, the sums as much faster: the same total
    _measuring(monkeypatch, slower * update, earlier - (slower - 1) * update)
    monkeypatch.setattr(host_calibration, "replan", lambda *a, **k: pytest.fail("the sums' gain outweighs: not searched"))
    monkeypatch.setattr(host_calibration, "SEARCH_AGAIN", 10.0)  # keep the layout: the scales are what is checked
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0, accumulation_steps=4)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "1.00x the" in said[0] and "plan kept" not in said[0], engine.plan.notes
    assert engine.plan.profile.host_update_scale == pytest.approx(slower)
    assert engine.plan.profile.host_earlier_scale == pytest.approx(1 - (slower - 1) * update / earlier)
    engine.close()


def test_a_send_before_the_last_micro_batch_is_priced_in_series_with_its_block_s_backward(accumulating_plan,
                                                                                         cpu_backend):
    # H200: host-summing plans ran over their predictions by the thread's send time in the
    # micro-batches before a step's last; device-summing blocks send nothing there.
    from strategies.memferry.scheduler import schedule, sums_on_host_by_choice

    plan, budget = accumulating_plan
    links = links_from_probe(cpu_backend, 0)
    host_blocks = sum(sums_on_host_by_choice(u) for u in plan.units)
    assert host_blocks > 0
    send = 5e-3  # long beside these blocks' copies: every send lands on the chain
    slowed = repriced(plan, with_sends(plan.profile, send), links, 0.0)
    n = plan.profile.accumulation_steps
    assert slowed.predicted_step_s == pytest.approx(plan.predicted_step_s + (n - 1) * host_blocks * send, rel=1e-6)
    device = schedule(plan.profile, links, budget, margin=0.0, host_sums=False)
    assert not any(sums_on_host_by_choice(u) for u in device.units)
    assert repriced(device, with_sends(device.profile, send), links, 0.0).predicted_step_s == device.predicted_step_s


def test_the_rehearsal_s_sends_calibrate_the_plan_though_its_host_rate_is_within_the_tolerance(
        cpu_backend, monkeypatch, accumulating_plan):
    plan, budget = accumulating_plan
    _measuring(monkeypatch, plan.host_s_per_param - plan.host_earlier_s_per_param, plan.host_earlier_s_per_param)
    monkeypatch.setattr(rehearsal_steps, "send_seconds", lambda post, since: 2e-3)
    monkeypatch.setattr(host_calibration, "SEARCH_AGAIN", 10.0)  # keep the layout: the pricing is what is checked
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0, accumulation_steps=4)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "(within the tolerance); sends before a step's last micro-batch took 2.00 ms" in said[0]
    assert engine.plan.profile.earlier_send_s == 2e-3 and engine.plan.predicted_step_s > plan.predicted_step_s
    assert same_layout(engine.plan, plan)
    engine.close()


def _rehearsed(cpu_backend, monkeypatch, host_plan, scale: float, timings):
    """An engine built on ``host_plan`` whose rehearsal's host updates run ``scale`` times the
    plan's price, the host kernel alone timed ``timings`` around each run of its steps."""
    plan, budget = host_plan
    _measuring(monkeypatch, scale * plan.host_update_s_per_param)
    monkeypatch.setattr(rehearsal_steps, "alone_slowdown", lambda engine: next(timings))
    return MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                    backend=cpu_backend, memory_margin=0.0), plan


def test_a_rehearsal_the_host_stays_disturbed_through_is_not_taken(cpu_backend, monkeypatch, host_plan):
    """The host kernel alone ran at its profiled rate before the rehearsal's steps and 1.4x after
    them, every time they ran (the host disturbed meanwhile, as right after pinning most of its
    memory), and the steps' updates 1.5x the plan's: the steps run 1 + ``SETTLE_TRIES`` times,
    the plan keeps its layout and rate, and the notes say why."""
    timings = iter([1.0, 1.4] * (1 + SETTLE_TRIES))
    engine, plan = _rehearsed(cpu_backend, monkeypatch, host_plan, 1.5, timings)
    notes = engine.plan.notes
    assert not any(n.startswith("host rate:") for n in notes), notes
    assert engine.plan.profile.host_update_scale == 1.0 and engine.plan.units == plan.units
    assert engine.plan.predicted_step_s == pytest.approx(plan.predicted_step_s)
    clock = [n for n in notes if n.startswith("rehearsal clock 1:")]
    assert len(clock) == 1 and "1.00x/1.40x; 1.00x/1.40x; 1.00x/1.40x its profiled rate" in clock[0], notes
    assert f"the steps ran {1 + SETTLE_TRIES} times" in clock[0] and "still disturbed" in clock[0]
    assert next(timings, None) is None  # timed before and after each run, no more
    engine.close()


def test_a_host_slower_on_both_sides_of_a_disturbed_rehearsal_counts_that_much(cpu_backend, monkeypatch, host_plan):
    """The kernel alone ran 1.2x its profiled rate before the steps and 1.4x after, every time,
    and the steps' updates 1.5x the plan's: the host was at least 1.2x slower all along, so the
    updates are priced 1.2x (not the disturbed 1.5x, not the profile's 1.0x)."""
    timings = iter([1.2, 1.4] * (1 + SETTLE_TRIES))
    engine, _ = _rehearsed(cpu_backend, monkeypatch, host_plan, 1.5, timings)
    notes = engine.plan.notes
    assert any(n.startswith("host rate:") and "updates 1.20x" in n for n in notes), notes
    assert engine.plan.profile.host_update_scale == pytest.approx(1.2)
    assert next(timings, None) is None
    engine.close()


def test_a_rehearsal_still_disturbed_is_taken_where_it_ran_under_the_price(cpu_backend, monkeypatch, host_plan):
    """Disturbed every time the steps ran, yet its updates ran 0.8x the plan's price: a disturbance
    only slows the host, so the plan is priced on 0.8x (the earlier sums, none here, keep theirs)."""
    timings = iter([1.2, 1.4] * (1 + SETTLE_TRIES))
    engine, _ = _rehearsed(cpu_backend, monkeypatch, host_plan, 0.8, timings)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "updates 0.80x" in said[0], said
    assert engine.plan.profile.host_update_scale == pytest.approx(0.8)
    clock = [n for n in engine.plan.notes if n.startswith("rehearsal clock 1:")]
    assert len(clock) == 1 and "counts at most at the plan's price times the kernel's slowdown alone" in clock[0], clock
    assert next(timings, None) is None
    engine.close()


def test_a_disturbed_rehearsal_runs_again_until_the_host_settles_and_is_calibrated_as_measured(
        cpu_backend, monkeypatch, host_plan):
    """Disturbed around the first run of the steps (1.3x alone after them), settled around the
    second (within ``DISTURBED``): the second run's 1.2x is the steps' own, and the plan is
    priced on it."""
    timings = iter([1.0, 1.3, 1.0, DISTURBED])  # DISTURBED itself counts as settled
    engine, _ = _rehearsed(cpu_backend, monkeypatch, host_plan, 1.2, timings)
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and "updates 1.20x" in said[0], said
    assert engine.plan.profile.host_update_scale == pytest.approx(1.2)
    clock = [n for n in engine.plan.notes if n.startswith("rehearsal clock 1:")]
    assert len(clock) == 1 and "the steps ran 2 times" in clock[0] and "still disturbed" not in clock[0], clock
    assert next(timings, None) is None
    engine.close()


def test_a_settled_rehearsal_reading_its_updates_over_the_ceiling_is_priced_at_it(cpu_backend, monkeypatch,
                                                                                   host_plan):
    """The kernel alone at its profiled rate around the steps, the updates 1.5x their price: the
    plan is priced at CEILING and the notes say what was read."""
    engine, _ = _rehearsed(cpu_backend, monkeypatch, host_plan, 1.5, iter([1.0, 1.0]))
    assert engine.plan.profile.host_update_scale == pytest.approx(CEILING)
    held = [n for n in engine.plan.notes if n.startswith("host ceiling:")]
    assert len(held) == 1 and "updates read 1.50x their price" in held[0], engine.plan.notes
    said = [n for n in engine.plan.notes if n.startswith("host rate:")]
    assert len(said) == 1 and f"updates {CEILING:.2f}x" in said[0], said
    engine.close()


def test_undisturbed_takes_a_rehearsal_only_where_the_host_settled():
    assert undisturbed((2e-9, 1e-9), (1.0, DISTURBED)) == (2e-9, 1e-9)
    assert undisturbed((2e-9, 1e-9), None) == (2e-9, 1e-9)  # not timed alone
    assert undisturbed((2e-9, 1e-9), (1.0, DISTURBED * 1.01)) is None
    assert undisturbed((2e-9, 1e-9), (DISTURBED * 1.01, 1.0)) is None
    assert undisturbed(None, (1.0, 1.0)) is None


def test_a_disturbed_rehearsal_counts_up_to_its_price_times_the_hosts_slowdown_alone():
    """A disturbance only slows the host: a part measured under its price bounds the rate from
    above and is taken; a part over its price keeps the price, times the slowdown the kernel
    alone showed on both sides of the steps; nothing under and no such slowdown: not taken."""
    plan = Plan([], host_s_per_param=3e-9, host_earlier_s_per_param=2e-9)  # updates priced 1e-9
    disturbed = (1.0, DISTURBED * 1.5)
    assert undisturbed((1.5e-9, 1.2e-9), disturbed, plan) == (plan.host_update_s_per_param, 1.2e-9)
    assert undisturbed((0.8e-9, 2.5e-9), disturbed, plan) == (0.8e-9, 2e-9)
    assert undisturbed((1.5e-9, 2.5e-9), disturbed, plan) is None
    assert undisturbed((1.5e-9, 1.2e-9), disturbed) is None  # no price to bound by
    assert undisturbed((1.5e-9, 1.2e-9), (1.0, 1.0), plan) == (1.5e-9, 1.2e-9)  # settled: as measured
    # the kernel alone slower on both sides: the host was that much slower all along, so each
    # part counts up to its price times the lesser slowdown, and as measured under that
    slow = (DISTURBED * 1.05, DISTURBED * 1.1)
    level = DISTURBED * 1.05
    assert undisturbed((1.5e-9, 2.5e-9), slow, plan) == pytest.approx((1e-9 * level, 2e-9 * level), rel=1e-12)
    assert undisturbed((1.05e-9, 2.5e-9), slow, plan) == pytest.approx((1.05e-9, 2e-9 * level), rel=1e-12)
    assert undisturbed((0.8e-9, 1.2e-9), slow, plan) == (0.8e-9, 1.2e-9)
    # priced as updates alone (no sums apart): the two parts count together, as ratios() counts them
    alone = Plan([], host_s_per_param=2e-9, host_earlier_s_per_param=0.0)
    assert undisturbed((1.0e-9, 0.5e-9), disturbed, alone) == pytest.approx((1.5e-9, 0.0), rel=1e-12)
    assert undisturbed((1.5e-9, 1.0e-9), disturbed, alone) is None
    assert undisturbed((1.5e-9, 1.0e-9), slow, alone) == pytest.approx((2e-9 * level, 0.0), rel=1e-12)


def test_a_settled_rehearsal_s_host_work_counts_at_most_at_the_ceiling_without_accumulation():
    """Where the kernel alone ran at its profiled rate around the steps and the plan prices no
    sums of earlier micro-batches, the host work counts at most at CEILING times its price, and
    the note says what was read; as measured under the ceiling, where the host was not timed
    alone or was disturbed (the price times its slowdown alone bounds it there), and where the
    plan prices sums (accumulation)."""
    plan = Plan([], host_s_per_param=2e-9, host_earlier_s_per_param=0.0)
    settled_pair = (1.0, DISTURBED)
    assert undisturbed((3.0e-9, 0.0), settled_pair, plan) == pytest.approx((CEILING * 2e-9, 0.0), rel=1e-12)
    assert undisturbed((2.0e-9, 1.0e-9), settled_pair, plan) == pytest.approx((CEILING * 2e-9, 0.0), rel=1e-12)
    assert undisturbed((2.4e-9, 0.0), settled_pair, plan) == (2.4e-9, 0.0)  # under it: as measured
    note = ceiling_note(plan, (3.0e-9, 0.0), undisturbed((3.0e-9, 0.0), settled_pair, plan), settled_pair)
    assert note == (f"host ceiling: the rehearsal's updates read 1.50x their price with the kernel alone settled "
                    f"around them; taken at {CEILING:.2f}x, the most timed steps have run over it")
    assert ceiling_note(plan, (2.2e-9, 0.0), (2.2e-9, 0.0), settled_pair) is None
    assert undisturbed((3.0e-9, 0.0), None, plan) == (3.0e-9, 0.0)  # not timed alone
    assert ceiling_note(plan, (3.0e-9, 0.0), (2e-9, 0.0), (1.0, DISTURBED * 1.5)) is None  # disturbed
    summing = Plan([], host_s_per_param=3e-9, host_earlier_s_per_param=2e-9)  # updates priced 1e-9
    assert undisturbed((1.5e-9, 2.5e-9), settled_pair, summing) == (1.5e-9, 2.5e-9)


def test_the_kernel_alone_is_timed_on_the_profiled_length_and_never_on_virtual_devices(cpu_backend, monkeypatch,
                                                                                      host_plan):
    """``alone_slowdown`` times the kernel on buffers as long as the profiler's (and none on
    virtual devices, whose "device" shares the host's cores); its figure is over the profile's."""
    plan, budget = host_plan
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    assert plan.profile.host_adamw_numel > 0
    assert host_calibration.alone_slowdown(engine) is None
    timed = []
    monkeypatch.setattr(host_calibration, "applies", lambda backend: True)
    monkeypatch.setattr(host_calibration, "host_adamw_rate", lambda numel, *a: timed.append(numel) or 3e-9)
    assert host_calibration.alone_slowdown(engine) == pytest.approx(3e-9 / plan.profile.host_adamw_s_per_param)
    assert timed == [plan.profile.host_adamw_numel]
    engine.close()
