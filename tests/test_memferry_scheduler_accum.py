"""Gradient accumulation in MemFerry's memory model: the scheduler's predicted peak against the
cpu backend's measured one when a step is several micro-batches.

With ``accumulation_steps > 1`` a device-homed unit's fp32 gradient buffer (4 bytes per
parameter) is allocated at the step's first micro-batch and freed only after its update, so
it is resident through every later forward, loss and backward; a profile of one micro-batch
sees it only as the update's transient. The model is a tied HF Qwen2 whose head dominates
(vocab 4096, hidden 32), as Qwen2-1.5B's 233 M-parameter tied head does under an 8 GB cap
(where counting the buffer as a transient let an out-of-memory plan through).
"""
from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

from strategies.memferry import AdamW, MemFerry
from strategies.memferry.config import Plan, UnitPlan
from strategies.memferry.cost import Links, grads_persist, held_grad_bytes, links_from_probe, predict
from strategies.memferry.hf_models import model_loss
from strategies.memferry.profiler import StepProfile, profile_step
from strategies.memferry.scheduler import min_budget, schedule
from strategies.memferry.units import split_units

VOCAB, HIDDEN, BATCH, SEQ, CHUNKS = 4096, 32, 2, 64, 8
#: The predicted peak may exceed the measured by this share, never fall below it.
OVER = 0.15


def qwen2_tied():
    pytest.importorskip("transformers")
    from strategies.models.hf import HFCausalLM

    torch.manual_seed(0)
    m = HFCausalLM({"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "tie_word_embeddings": True}, seq=SEQ)
    m.loss_chunks = CHUNKS
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


@pytest.fixture(scope="module")
def setup():
    """The model, one batch and its profile (accumulation 1), shared: profiling is the slow part."""
    pytest.importorskip("transformers")
    import xpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPU_BACKEND", "cpu")
        xpu.reset_backend()
        backend = xpu.get_backend()
        model = qwen2_tied()
        x, y = batch()
        prof = profile_step(model, split_units(model, model.blocks), backend, 0, x, y, blocks=model.blocks, repeats=1,
                            adamw_numel=1 << 16)
        xpu.reset_backend()
    return model, x, y, prof


def with_accumulation(prof: StepProfile, n: int) -> StepProfile:
    return dataclasses.replace(prof, accumulation_steps=n)


#: measured_peak's readings by (model, plan, n, cap, clip): several tests compare the same runs
#: (the cpu backend's byte counts are exact, so a run gives the same peak each time it is made).
_PEAKS: dict[tuple, int] = {}


def measured_peak(backend, model, plan, n, x, y, cap=None, clip=None) -> int:
    """Peak device bytes of the second step of ``n`` micro-batches (the first allocates the
    steady state), over what the device held before the engine existed; under ``cap`` if given,
    clipping at ``clip`` if given. Read once per run (``_PEAKS``)."""
    key = (id(model), repr(plan), n, cap, clip)
    if key not in _PEAKS:
        _PEAKS[key] = _measure_peak(backend, model, plan, n, x, y, cap, clip)
    return _PEAKS[key]


def _measure_peak(backend, model, plan, n, x, y, cap, clip) -> int:
    gc.collect()
    before = backend.memory_stats(0).allocated
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3, max_grad_norm=clip), plan=plan, backend=backend,
                      device_budget=cap, accumulation_steps=n)
    for _ in range(2):
        backend.synchronize(0)
        backend.reset_peak_memory(0)
        for _ in range(n):
            engine.backward(model_loss(engine, x, y, labels_model=engine.model))
        engine.step()
        backend.synchronize(0)
    peak = backend.memory_stats(0).peak_allocated - before
    engine.close()
    return peak


def loaded_in_second_step(backend, model, plan, n, x, y) -> int:
    """Bytes of weights the executor copies to the device in the second step of ``n``
    micro-batches (the first loads the resident blocks for the first time)."""
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3), plan=plan, backend=backend, accumulation_steps=n)
    try:
        for _ in range(2):
            before = engine.executor.bytes_h2d
            for _ in range(n):
                engine.backward(model_loss(engine, x, y, labels_model=engine.model))
            engine.step()
        return engine.executor.bytes_h2d - before
    finally:
        engine.close()


def plans() -> dict[str, Plan]:
    host = Plan.uniform(2, UnitPlan("prefetch", "prefetch", recompute=True))
    device = Plan.from_spec("device2", 2)
    return {"host": host, "device-blocks": dataclasses.replace(device, rest_optimizer="host"),
            "device-all": dataclasses.replace(device, rest_optimizer="device")}


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", ["host", "device-blocks", "device-all"])
def test_predicted_peak_bounds_the_measured_one_for_every_accumulation(cpu_backend, setup, name, n):
    """Host-homed, device-homed blocks, and everything device-homed (the tied head too): the
    prediction (margin 0) with the run's accumulation_steps is at least the measured peak of
    ``n`` micro-batches and at most ``OVER`` above it."""
    model, x, y, prof = setup
    plan = plans()[name]
    pred = predict(plan, with_accumulation(prof, n), links_from_probe(cpu_backend, 0), 0.0).peak_bytes
    got = measured_peak(cpu_backend, model, plan, n, x, y)
    assert pred * (1 - OVER) <= got <= pred, (name, n, pred, got)


def test_accumulation_holds_exactly_the_device_homed_fp32_gradients(cpu_backend, setup):
    """What grows with accumulation is 4 bytes per device-homed parameter (the fp32 gradient
    buffers), nothing of host-homed units; the old prediction (the profile's accumulation 1)
    falls below the measured peak of 4 micro-batches, the new one does not."""
    model, x, y, prof = setup
    links = links_from_probe(cpu_backend, 0)
    device_numel = prof.rest_numel + sum(b.numel for b in prof.blocks)
    host, device = plans()["host"], plans()["device-all"]
    assert measured_peak(cpu_backend, model, host, 4, x, y) == measured_peak(cpu_backend, model, host, 1, x, y)
    one, four = (measured_peak(cpu_backend, model, device, n, x, y) for n in (1, 4))
    assert four - one == 4 * device_numel
    assert predict(device, prof, links, 0.0).peak_bytes < four <= predict(device, with_accumulation(prof, 4), links,
                                                                          0.0).peak_bytes
    assert not grads_persist(prof) and grads_persist(with_accumulation(prof, 2))


def test_a_resident_host_homed_block_reloads_once_a_step_and_is_priced_so(cpu_backend, setup):
    """A resident block updated on the host is copied to the device once a step, after its
    update, however many micro-batches the step has (the executor reloads a block only when its
    host copy changed); the cost model charges that reload to the step's last micro-batch alone.
    It had charged every earlier micro-batch too, which priced resident weights out of plans
    under accumulation (design §3, 8 micro-batches: 7 x 1.8 ms a block)."""
    model, x, y, prof = setup
    plan = dataclasses.replace(Plan.from_spec("resident2", 2), rest_optimizer="device")
    weights = sum(b.param_bytes for b in prof.blocks)
    assert (loaded_in_second_step(cpu_backend, model, plan, 1, x, y)
            == loaded_in_second_step(cpu_backend, model, plan, 4, x, y) == weights)
    links = links_from_probe(cpu_backend, 0)
    slow = dataclasses.replace(links, h2d_GBps=links.h2d_GBps / 100)
    fast_p, slow_p = (predict(plan, with_accumulation(prof, 4), lk, 0.0) for lk in (links, slow))
    reload = weights / (slow.h2d_GBps * 1e9) - weights / (links.h2d_GBps * 1e9)
    assert slow_p.parts["forward_s"] - fast_p.parts["forward_s"] == pytest.approx(reload)
    assert slow_p.parts["earlier_micro_batches_s"] == pytest.approx(fast_p.parts["earlier_micro_batches_s"])


def test_a_stale_resident_block_is_reloaded_while_the_block_above_computes(cpu_backend, setup):
    """The executor issues a stale resident block's reload at the pre-forward of the block above
    it, as it issues a prefetch, before that block's forward runs, so the reload can overlap that
    block's compute. The cost model still charges it in series (``r`` in ``phi``: an upper bound);
    overlapping it there widened the search's fronts past the label cap (docs/design.md Session 32)."""
    model, x, y, prof = setup
    plan = dataclasses.replace(Plan.from_spec("resident2", 2), rest_optimizer="device")
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3), plan=plan, backend=cpu_backend)
    events: list[tuple[str, int]] = []
    executor, issue = engine.executor, engine.executor._issue_load

    def recorded_load(s):
        before = executor.bytes_h2d
        issue(s)
        if executor.bytes_h2d > before:
            events.append(("load", s.unit.index))

    executor._issue_load = recorded_load
    blocks = list(executor.blocks)
    for s in blocks:  # registered after the executor's own hook: runs after it, as the block's forward starts
        s.unit.module.register_forward_pre_hook(lambda m, a, i=s.unit.index: events.append(("fwd", i)))
    try:
        for _ in range(2):
            events.clear()
            engine.backward(model_loss(engine, x, y, labels_model=engine.model))
            engine.step()
    finally:
        engine.close()
    first, second = blocks[0].unit.index, blocks[1].unit.index
    assert ("load", second) in events  # stale after the first step's update: reloaded once
    assert events.index(("load", second)) < events.index(("fwd", first)), events


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("spec", ["prefetch", "prefetch+recompute", "resident2", "mixed"])
def test_the_weights_the_executor_loads_are_the_ones_the_cost_model_moves(cpu_backend, setup, spec, n):
    """Bytes of weights copied to the device in a step of ``n`` micro-batches: what the cost
    model's ``link_bytes`` counts host to device (each micro-batch's forward and backward copies,
    and a stale resident block's reload and a host-homed ``rest``'s once a step) is what the
    executor loads."""
    from strategies.memferry.host_budget import link_bytes

    model, x, y, prof = setup
    if spec == "mixed":  # a resident host-homed block under a prefetched one
        plan = Plan([UnitPlan("resident", "resident"), UnitPlan("prefetch", "prefetch")], 1, "host")
    else:
        plan = dataclasses.replace(Plan.from_spec(spec, 2), rest_optimizer="host")
    expected = prof.rest_param_bytes  # rest: host-homed, reloaded after its update
    for i, (blk, unit) in enumerate(zip(prof.blocks, plan.units)):
        kept = unit.forward == unit.backward == "prefetch" and i >= len(prof.blocks) - plan.prefetch_depth
        grads = blk.numel * prof.dtype_bytes  # host-homed: the gradient goes the other way
        fwd, bwd, reload = link_bytes(unit, blk.param_bytes, grads, blk.act_bytes, kept, host=True)
        expected += n * (fwd + bwd - grads) + reload
    assert loaded_in_second_step(cpu_backend, model, plan, n, x, y) == expected


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("rest", [("device",), ("host", "device")])
def test_the_smallest_budget_trains_n_micro_batches(cpu_backend, setup, n, rest):
    """The scheduler's smallest budget, for a device-homed ``rest`` (the bench's case: the tied
    head updated on the device) or either home, runs two steps of ``n`` micro-batches under a
    cap of exactly that budget; with a device-homed head at n = 4, the budget planned for one
    micro-batch would be too small."""
    model, x, y, prof = setup
    links = links_from_probe(cpu_backend, 0)
    acc = with_accumulation(prof, n)
    budget = min_budget(acc, links, rest_optimizers=rest, margin=0.0)
    plan = schedule(acc, links, budget, allow_dha=False, rest_optimizers=rest, margin=0.0, explain=False)
    assert plan.rest_optimizer in rest
    got = measured_peak(cpu_backend, model, plan, n, x, y, cap=budget)
    assert budget * (1 - OVER) <= got <= budget
    if n > 1 and rest == ("device",):
        assert min_budget(prof, links, rest_optimizers=rest, margin=0.0) < got


def test_device_sums_are_within_the_predicted_peak_and_chosen_where_the_budget_allows(cpu_backend, setup):
    """Blocks summing 4 micro-batches on the device (``accumulate="device"``) hold 4 bytes per
    block parameter more than summing on the host, measured, within the predicted peak; on a
    host slow enough to bound the step, the scheduler sums some block on the device under that
    plan's predicted peak (not under the host-summing plan's) and predicts a shorter step than
    the same plan summing on the host."""
    model, x, y, prof = setup
    links = links_from_probe(cpu_backend, 0)
    acc = with_accumulation(prof, 4)
    summed = Plan.uniform(2, UnitPlan("prefetch", "prefetch", recompute=True, accumulate="device"))
    got = measured_peak(cpu_backend, model, summed, 4, x, y)
    pred = predict(summed, acc, links, 0.0).peak_bytes
    assert pred * (1 - OVER) <= got <= pred
    assert got - measured_peak(cpu_backend, model, plans()["host"], 4, x, y) == 4 * sum(b.numel for b in prof.blocks)
    slow = dataclasses.replace(acc, host_adamw_s_per_param=acc.host_adamw_s_per_param * 1000)
    on_host = lambda plan: dataclasses.replace(plan, units=[dataclasses.replace(u, accumulate="host") for u in plan.units])
    for budget, sums in ((predict(plans()["host"], slow, links, 0.0).peak_bytes, False),
                         (predict(summed, slow, links, 0.0).peak_bytes, True)):
        plan = schedule(slow, links, budget, allow_dha=False, margin=0.0, explain=False)
        assert any(u.accumulate == "device" for u in plan.units) == sums, plan.describe()
        if sums:
            assert plan.predicted_step_s < predict(on_host(plan), slow, links, 0.0).step_s
            assert "accumulate=device" in plan.describe()


def test_clipping_holds_the_device_homed_gradients_and_the_prediction_places_them(cpu_backend, setup):
    """With clipping the device optimizer holds every device-homed gradient until ``step()``, from
    the unit's backward on: the measured peak stays under the prediction that places them, for
    plans that keep or recompute activations and update ``rest`` on either side."""
    model, x, y, prof = setup
    links = links_from_probe(cpu_backend, 0)
    clipped = dataclasses.replace(prof, clipping=True)
    # held as autograd made them (the compute dtype: fp32 here, 2 bytes in bf16); fp32 sums under data parallelism
    assert held_grad_bytes(clipped) == prof.dtype_bytes == 4 and held_grad_bytes(prof) == 0
    assert held_grad_bytes(dataclasses.replace(clipped, dtype_bytes=2)) == 2
    assert grads_persist(dataclasses.replace(clipped, data_parallel=True)) and not grads_persist(clipped)
    for spec in ("device2", "device2+recompute"):
        for rest in ("device", "host"):
            plan = dataclasses.replace(Plan.from_spec(spec, 2), rest_optimizer=rest)
            got = measured_peak(cpu_backend, model, plan, 1, x, y, clip=1.0)
            pred = predict(plan, clipped, links, 0.0).peak_bytes
            assert pred * (1 - OVER) <= got <= pred, (spec, rest)
            assert measured_peak(cpu_backend, model, plan, 1, x, y) <= predict(plan, prof, links, 0.0).peak_bytes


def _held_profile(act: int, act_recompute: int) -> StepProfile:
    """Three equal blocks of 10**6 parameters (bf16 gradients: 2 MB each) and a loss that
    never sets the peak."""
    from strategies.memferry.profiler import BlockProfile

    block = BlockProfile(10**6, 2 * 10**6, 1e-3, 2e-3, act, act_recompute)
    return StepProfile([block] * 3, 10**5, 2 * 10**5, 1e-4, 2e-4, 1, 0, 2, 1024, 1e-9, 1e-11, clipping=True)


KEEP, RECOMPUTE = UnitPlan("resident", "resident", optimizer="device"), UnitPlan(
    "resident", "resident", recompute=True, optimizer="device")


@pytest.mark.parametrize("units, act, held", [
    ([KEEP] * 3, 5 * 10**6, 0),  # each backward frees more activations than its gradients take
    # it frees only the block inputs: at block 0's backward (its own gradient in its transient,
    # beside its rebuilt activations) blocks 1-2 hold 4 MB and freed 0.2; the end's 5.7 MB come
    # after that transient is gone
    ([RECOMPUTE] * 3, 5 * 10**6, 2 * (2 * 10**6 - 10**5)),
    # 1 MB freed per 2 MB held: at block 0's backward blocks 1-2 hold 2 MB net (its own gradient
    # is in its transient, gone by the step's end)
    ([KEEP] * 3, 10**6, 2 * (2 * 10**6 - 10**6)),
    # clipped, the worst is block 0's backward: blocks 1-2 hold 3.8 MB net beside its weights'
    # gradients, its update's fp32 buffer and its input (6.1 MB; at block 1's, 1.9 MB beside 7 MB
    # rebuilt and made); unclipped, block 2's 7 MB with nothing held
    ([KEEP, RECOMPUTE, RECOMPUTE], 5 * 10**6, 3.8 * 10**6 + 6.1 * 10**6 - 7 * 10**6),
])
def test_held_gradients_add_what_backward_has_not_freed(units, act, held):
    """Backward at block s holds the activations of blocks 0..s and the gradients of the blocks
    above: the prediction adds the largest excess of held gradients over freed activations (at a
    block's backward or at the step's end), not every held gradient."""
    clipped = _held_profile(act, 10**5)
    links = Links(20.0, 20.0, None)
    plan = Plan(units, 1, "device")
    unclipped = dataclasses.replace(clipped, clipping=False)
    assert predict(plan, clipped, links, 0.0).peak_bytes - predict(plan, unclipped, links, 0.0).peak_bytes == held


def test_plan_auto_passes_accumulation_steps_to_the_scheduler(cpu_backend, monkeypatch):
    """``MemFerry(plan="auto", accumulation_steps=4)`` schedules with the profile's
    ``accumulation_steps`` 4 and trains under the budget it was given."""
    import strategies.memferry.scheduler as scheduler

    seen = []
    real = scheduler.schedule

    def spy(profile, *args, **kwargs):
        seen.append(profile.accumulation_steps)
        return real(profile, *args, **kwargs)

    monkeypatch.setattr(scheduler, "schedule", spy)
    model = qwen2_tied()
    x, y = batch()
    budget = 6_000_000
    engine = MemFerry(model, optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=budget,
                      backend=cpu_backend, accumulation_steps=4)
    assert seen == [4]
    cpu_backend.reset_peak_memory(0)  # the profile ran before the cap
    for _ in range(4):
        engine.backward(model_loss(engine, x, y, labels_model=engine.model))
    engine.step()
    assert cpu_backend.memory_stats(0).peak_allocated <= budget
    engine.close()


def test_plan_for_refuses_a_bad_accumulation_steps(cpu_backend):
    from strategies.memferry.planning import plan_for

    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        plan_for(torch.nn.Linear(2, 2), None, accumulation_steps=0, backend=cpu_backend)


def test_profiles_written_before_accumulation_steps_load_as_one_micro_batch(setup):
    _, _, _, prof = setup
    data = dataclasses.asdict(prof)
    del data["accumulation_steps"]
    import json

    old = StepProfile.from_json(json.dumps(data))
    assert old.accumulation_steps == 1 and not grads_persist(old)
