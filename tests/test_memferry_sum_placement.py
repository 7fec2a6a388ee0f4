"""Where accumulated micro-batches are summed (``sum_placement.py``): a scheduled plan that sums
on the host is rehearsed against the scheduler's best plan summing on the device, and the one
whose rehearsed step took less wall-clock time is kept.

The comparison runs where the rehearsal is timed (real devices); these tests turn the timing on
and set each plan's step time, so nothing depends on this machine's speed."""
from __future__ import annotations

import pytest

import strategies.memferry.rehearsal as rehearsal
import strategies.memferry.sum_placement as sum_placement
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.cost import links_from_probe
from strategies.memferry.host_calibration import same_layout
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.scheduler import schedule, sums_on_host_by_choice
from strategies.memferry.sum_placement import device_summed_blocks, host_summed_blocks
from tests.rehearsal_here import rehearse_here
from tests.test_memferry_host_calibration import (_accumulating_plan, _host_plan,  # noqa: F401  (fixtures)
                                                  accumulating_plan, host_plan)
from tests.test_memferry_rehearsal import true_min_budget  # noqa: F401  (a fixture)
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def _clocked(monkeypatch, host_summing_s: float, device_summing_s: float) -> list[tuple[int, bool]]:
    """Timed rehearsals report ``host_summing_s`` per step for a plan summing any block on the
    host, else ``device_summing_s``; the host runs at each plan's own rate. Returns the
    rehearsals as (host-summed blocks, timed)."""
    rehearse_here(monkeypatch)
    monkeypatch.setattr(HostOptimizer, "split_since", lambda self, start: None)  # nothing to calibrate
    real = rehearsal._rehearse
    calls: list[tuple[int, bool]] = []

    def clocked(engine, sample, timed=False):
        got = real(engine, sample, timed)
        calls.append((host_summed_blocks(engine.plan), timed))
        if not timed:
            return got
        step_s = host_summing_s if host_summed_blocks(engine.plan) else device_summing_s
        return got._replace(clock=(rehearsal.Clocked(step_s, 0.0, 0.0),) * rehearsal.CLOCKED_STEPS)

    monkeypatch.setattr(rehearsal, "_rehearse", clocked)
    monkeypatch.setattr(sum_placement, "WINDOW", 10.0)  # whatever the two predictions: compare them
    return calls


def _engine(plan, budget, cpu_backend, **kwargs):
    return MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                    backend=cpu_backend, memory_margin=0.0, accumulation_steps=4, **kwargs)


def test_the_scheduler_can_be_told_to_sum_every_block_it_can_on_the_device(accumulating_plan,  # noqa: F811
                                                                         cpu_backend):
    plan, budget = accumulating_plan
    assert host_summed_blocks(plan) > 0  # the model's own choice sums some on the host
    other = schedule(plan.profile, links_from_probe(cpu_backend, 0), budget, margin=0.0, host_sums=False)
    assert host_summed_blocks(other) == 0
    assert any(u.accumulate == "device" for u in other.units)
    assert not any(sums_on_host_by_choice(u) for u in other.units)
    assert other.predicted_peak_bytes <= budget


def test_a_faster_device_summing_plan_is_kept(accumulating_plan, cpu_backend, monkeypatch):  # noqa: F811
    plan, budget = accumulating_plan
    calls = _clocked(monkeypatch, host_summing_s=2.0, device_summing_s=1.0)
    engine = _engine(plan, budget, cpu_backend)
    assert host_summed_blocks(engine.plan) == 0 and engine.executor.plan is engine.plan
    assert [timed for _, timed in calls] == [True, True]  # each plan timed once, nothing built again
    assert engine.plan.rehearsed_step_s == 1.0
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert len(said) == 2 and "rehearsed too" in said[0] and said[1].endswith("1000.0 ms: kept"), said
    x, y = batch()
    assert float(engine.train_step(x, y)) > 0
    engine.close()


def test_a_slower_device_summing_plan_gives_way_to_the_host_summing_one(accumulating_plan,  # noqa: F811
                                                                        cpu_backend, monkeypatch):
    plan, budget = accumulating_plan
    calls = _clocked(monkeypatch, host_summing_s=1.0, device_summing_s=1.5)
    engine = _engine(plan, budget, cpu_backend)
    assert same_layout(engine.plan, plan) and engine.executor.plan is engine.plan
    # the host-summing plan timed, the device-summing one timed, the first built again (memory only)
    assert calls == [(host_summed_blocks(plan), True), (0, True), (host_summed_blocks(plan), False)]
    assert engine.plan.rehearsed_step_s == 1.0
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert said[-1].endswith("1500.0 ms: the host-summing plan kept"), said
    assert cpu_backend.memory_cap(0) == engine.plan.predicted_peak_bytes  # held to the plan kept
    engine.close()


def test_a_device_summing_plan_predicted_far_slower_is_not_rehearsed(accumulating_plan,  # noqa: F811
                                                                     cpu_backend, monkeypatch):
    plan, budget = accumulating_plan
    calls = _clocked(monkeypatch, host_summing_s=2.0, device_summing_s=1.0)
    monkeypatch.setattr(sum_placement, "WINDOW", -1.0)  # no prediction is close enough
    engine = _engine(plan, budget, cpu_backend)
    assert same_layout(engine.plan, plan) and calls == [(host_summed_blocks(plan), True)]
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert len(said) == 1 and said[0].endswith("not rehearsed"), said
    engine.close()


@pytest.mark.parametrize("device_faster", [False, True])
def test_a_device_summing_pick_is_raced_against_the_best_host_summing_plan(accumulating_plan,  # noqa: F811
                                                                           cpu_backend, monkeypatch, device_faster):
    plan, budget = accumulating_plan
    first = schedule(plan.profile, links_from_probe(cpu_backend, 0), budget, margin=0.0, host_sums=False)
    assert host_summed_blocks(first) == 0 and device_summed_blocks(first) > 0  # the pick sums on the device
    calls = _clocked(monkeypatch, host_summing_s=2.0 if device_faster else 1.0,
                     device_summing_s=1.0 if device_faster else 2.0)
    engine = _engine(first, budget, cpu_backend)
    assert engine.executor.plan is engine.plan
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert said[0].startswith(f"sum placement: the plan summing {device_summed_blocks(first)} blocks' micro-batches "
                              "on the device") and "the best plan summing on the host" in said[0], said
    host_blocks = host_summed_blocks(schedule(plan.profile, links_from_probe(cpu_backend, 0), budget, margin=0.0,
                                              device_sums=False))
    if device_faster:  # the first plan built again, its memory rehearsed untimed
        assert same_layout(engine.plan, first) and calls == [(0, True), (host_blocks, True), (0, False)]
        assert said[-1].endswith("2000.0 ms: the device-summing plan kept"), said
    else:
        assert host_summed_blocks(engine.plan) == host_blocks > 0 and calls == [(0, True), (host_blocks, True)]
        assert said[-1].endswith("1000.0 ms: kept") and engine.plan.rehearsed_step_s == 1.0, said
    engine.close()


def test_told_to_keep_the_schedulers_pick_the_engine_races_nothing(accumulating_plan,  # noqa: F811
                                                                   cpu_backend, monkeypatch):
    plan, budget = accumulating_plan
    calls = _clocked(monkeypatch, host_summing_s=2.0, device_summing_s=1.0)
    monkeypatch.setattr(sum_placement, "replan", lambda *a, **k: pytest.fail("sum_placement='plan': no race"))
    engine = _engine(plan, budget, cpu_backend, sum_placement="plan")
    assert same_layout(engine.plan, plan) and calls == [(host_summed_blocks(plan), True)]
    assert not any(n.startswith("sum placement:") for n in engine.plan.notes)
    engine.close()
    with pytest.raises(ValueError, match=r"sum_placement must be one of \('race', 'plan'\), got 'fast'"):
        MemFerry(qwen2_tied(), sum_placement="fast", backend=cpu_backend)


def test_without_accumulation_there_is_nothing_to_place(host_plan, cpu_backend, monkeypatch):  # noqa: F811
    plan, budget = host_plan
    _clocked(monkeypatch, host_summing_s=2.0, device_summing_s=1.0)
    monkeypatch.setattr(sum_placement, "replan", lambda *a, **k: pytest.fail("one micro-batch: no sums to place"))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=batch(), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    assert same_layout(engine.plan, plan)
    assert not any(n.startswith("sum placement:") for n in engine.plan.notes)
    engine.close()


@pytest.mark.parametrize("device_faster", [False, True])
def test_a_plan_the_host_rate_check_moved_to_the_other_side_races_the_one_it_replaced(
        accumulating_plan, cpu_backend, monkeypatch, device_faster):  # noqa: F811 (a fixture)
    # The calibrated search can move to the other placement (H200, session 24: to device sums,
    # which ran 8 % faster there; on another lease host sums had rehearsed 4 % faster). Both
    # are then timed already: no search for another rival.
    plan, budget = accumulating_plan
    device = schedule(plan.profile, links_from_probe(cpu_backend, 0), budget, margin=0.0, host_sums=False)
    calls = _clocked(monkeypatch, host_summing_s=2.0 if device_faster else 1.0,
                     device_summing_s=1.0 if device_faster else 2.0)
    checked = []
    monkeypatch.setattr(rehearsal, "checked_plan", lambda engine, *a, **k: checked.append(1) or device)
    monkeypatch.setattr(sum_placement, "replan", lambda *a, **k: pytest.fail("both sides are timed: no search"))
    engine = _engine(plan, budget, cpu_backend)
    assert checked == [1]  # once per engine
    hb = host_summed_blocks(plan)
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert said[0].startswith("sum placement: the host-rate check moved the plan from summing on the host "
                              f"(rehearsed at {2000.0 if device_faster else 1000.0:.1f} ms per step) to summing "
                              "on the device"), said
    assert engine.plan.rehearsed_step_s == 1.0 and engine.executor.plan is engine.plan
    if device_faster:
        assert calls == [(hb, True), (0, True)] and same_layout(engine.plan, device)
        assert said[-1].endswith("1000.0 ms: kept"), said
    else:  # the replaced plan built again, its memory rehearsed untimed
        assert calls == [(hb, True), (0, True), (hb, False)] and same_layout(engine.plan, plan)
        assert said[-1].endswith("2000.0 ms: the host-summing plan kept"), said
    engine.close()


def test_a_plan_the_host_rate_check_replaced_on_the_same_side_is_raced_against_a_searched_rival(
        accumulating_plan, cpu_backend, monkeypatch):  # noqa: F811 (a fixture)
    import dataclasses

    plan, budget = accumulating_plan
    deeper = dataclasses.replace(plan, prefetch_depth=plan.prefetch_depth + 1, notes=list(plan.notes))
    assert not same_layout(deeper, plan) and host_summed_blocks(deeper) == host_summed_blocks(plan)
    calls = _clocked(monkeypatch, host_summing_s=1.0, device_summing_s=2.0)
    monkeypatch.setattr(rehearsal, "checked_plan", lambda engine, *a, **k: deeper)
    engine = _engine(plan, budget, cpu_backend)
    hb = host_summed_blocks(plan)
    # the first, the replacing one (timed: it may race), its searched rival, the replacing one again
    assert calls == [(hb, True), (hb, True), (0, True), (hb, False)]
    assert same_layout(engine.plan, deeper) and engine.plan.rehearsed_step_s == 1.0
    said = [n for n in engine.plan.notes if n.startswith("sum placement:")]
    assert "rehearsed too" in said[0] and said[-1].endswith("2000.0 ms: the host-summing plan kept"), said
    engine.close()


def test_a_raced_plan_kept_is_priced_on_its_own_host_rate(accumulating_plan, cpu_backend, monkeypatch):  # noqa: F811
    """The race's winner was priced on the rates the first plan's rehearsal measured; its own
    timed rehearsal measured its host work too, and the plan kept is priced on that."""
    plan, budget = accumulating_plan
    _clocked(monkeypatch, host_summing_s=2.0, device_summing_s=1.0)
    rehearsing: dict[str, object] = {}
    clocked = rehearsal._rehearse

    def noting(engine, sample, timed=False):
        rehearsing["plan"] = engine.plan
        return clocked(engine, sample, timed)

    def measured(self, start):  # the host-summing plan at its price, the device-summing one at half
        p = rehearsing["plan"]
        share = 1.0 if host_summed_blocks(p) else 0.5
        return (p.host_update_s_per_param * share, p.host_earlier_s_per_param or 0.0) if self.updated_numel else None

    monkeypatch.setattr(rehearsal, "_rehearse", noting)
    monkeypatch.setattr(HostOptimizer, "split_since", measured)
    engine = _engine(plan, budget, cpu_backend)
    assert host_summed_blocks(engine.plan) == 0 and engine.executor.plan is engine.plan
    said = [n for n in engine.plan.notes if "in its own rehearsal" in n]
    assert len(said) == 1 and "ran 0.50x its updates' price" in said[0], engine.plan.notes
    assert engine.plan.profile.host_update_scale == pytest.approx(0.5)
    rival = rehearsing["plan"]  # the device-summing plan as built, priced on the first plan's rates
    assert same_layout(engine.plan, rival)
    assert engine.plan.host_update_s_per_param == pytest.approx(0.5 * rival.host_update_s_per_param)
    engine.close()
