"""MemFerry's rehearsal step (``rehearsal.py``): a scheduled plan is run once at learning rate 0
with the cap lifted before training; one that peaks over its budget is made again with a margin
covering what the prediction missed, and training then stays under the cap. The rehearsal leaves
the engine exactly as if it had not run.

The memory model is made to under-count on purpose (a profile whose activations and loss peak
are scaled down), so the first plan's real peak is over the budget."""
from __future__ import annotations

import copy
import dataclasses
import time
import weakref

import pytest
import torch

import strategies.memferry.profiler as profiler
import strategies.memferry.rehearsal as rehearsal
import strategies.memferry.rehearsal_steps as rehearsal_steps
import strategies.memferry.sum_placement as sum_placement
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.cost import links_from_probe
from strategies.memferry.hf_models import model_loss
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.planning import plan_for
from strategies.memferry.scheduler import NoPlanFitsError, min_budget
from strategies.memferry.shadow import ShadowModel
from tests.rehearsal_here import rehearse_here
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def _undercounting(monkeypatch, share: float) -> None:
    """Profiles from now on count ``share`` of the activations and the loss peak."""
    real = profiler.profile_step

    def scaled(*args, **kwargs):
        p = real(*args, **kwargs)
        p.blocks = [dataclasses.replace(b, act_bytes=int(b.act_bytes * share),
                                        act_bytes_recompute=int(b.act_bytes_recompute * share)) for b in p.blocks]
        p.loss_peak_bytes = int(p.loss_peak_bytes * share)
        return p

    monkeypatch.setattr(profiler, "profile_step", scaled)


_FREE_PLANS: dict[int, Plan] = {}


def free_plan(backend, accumulation_steps: int = 1) -> Plan:
    """``plan_for`` of ``qwen2_tied()`` on ``batch()`` with no budget (margin 0): profiled and
    scheduled once per accumulation for the module (profiling is most of a test's work here);
    each caller gets its own copy."""
    if accumulation_steps not in _FREE_PLANS:
        _FREE_PLANS[accumulation_steps] = plan_for(qwen2_tied(), batch(), None, backend=backend, memory_margin=0.0,
                                                   accumulation_steps=accumulation_steps)
    return copy.deepcopy(_FREE_PLANS[accumulation_steps])


@pytest.fixture(scope="module")
def true_min_budget():
    """The smallest budget of the true profile (margin 0): a plan exists that really fits it."""
    import xpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPU_BACKEND", "cpu")
        xpu.reset_backend()
        backend = xpu.get_backend()
        # its own profile, not free_plan's: other modules take this fixture under patches of their own
        plan = plan_for(qwen2_tied(), batch(), None, backend=backend, memory_margin=0.0)
        budget = min_budget(plan.profile, links_from_probe(backend, 0), margin=0.0)
        xpu.reset_backend()
    return budget


def test_a_plan_over_its_budget_is_made_again_and_trains_under_the_cap(cpu_backend, monkeypatch, true_min_budget,
                                                                        caplog):
    """The warning names what overshot: its peak allocated, its prediction, the reserved bytes by
    stream (the engine's streams by name) and its layout."""
    import logging

    from xpu.stream_pools import StreamPool

    _undercounting(monkeypatch, 0.8)
    # A caching allocator's split; the virtual device keeps none.
    monkeypatch.setattr(type(cpu_backend), "reserved_by_stream", lambda self, device=None, streams=None: {
        name: StreamPool(i << 20, 0, 0) for i, name in enumerate(streams or {}, start=1)})
    budget = int(true_min_budget * 1.1)
    x, y = batch()
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=budget,
                          backend=cpu_backend, memory_margin=0.0)
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and "(after margin 0% peaked at" in note[0], engine.plan.notes
    assert "one step held to" not in note[0]  # allocated over the budget too: no step under the cap tried
    by_stream = "by stream: compute 1.0 MB, h2d 2.1 MB, d2h 3.1 MB"
    assert " allocated; " + by_stream + ")" in note[0] and "; reserved " + by_stream + "; " in note[0], note[0]
    said = [r.getMessage() for r in caplog.records if "in its rehearsal step" in r.getMessage()]
    assert len(said) == 1 and " allocated; predicted " in said[0] and "planning again with memory margin" in said[0]
    assert "; reserved " + by_stream + ")" in said[0], said[0]
    layout = said[0].split("(its blocks: ")[1].split("; prefetch depth")[0]
    assert sum(int(part.split("x ")[0]) for part in layout.split(", ")) == len(engine.plan.units), said[0]
    cpu_backend.reset_peak_memory(0)
    for _ in range(2):
        engine.train_step(x, y)
    assert cpu_backend.memory_stats(0).peak_allocated <= budget
    engine.close()


def test_what_earlier_work_left_cached_is_not_the_plan_s_peak(cpu_backend, monkeypatch, true_min_budget):
    """A caching allocator's peak of reserved bytes starts, after a reset, at what it holds:
    blocks cached by earlier work (the profiler's runs, a previous attempt) over the budget would
    make every plan "peak" over it. The rehearsal gives the cache back before it measures."""
    budget = int(true_min_budget * 1.1)
    cached = {"bytes": budget + (64 << 20)}  # reserved before the rehearsal, none of it in use
    real_stats = type(cpu_backend).memory_stats

    def stats(self, device=None):
        s = real_stats(self, device)
        return dataclasses.replace(s, peak_reserved=max(s.peak_reserved, cached["bytes"]))

    monkeypatch.setattr(type(cpu_backend), "memory_stats", stats)
    monkeypatch.setattr(type(cpu_backend), "release_cache", lambda self, device=None: cached.update(bytes=0))
    x, y = batch()
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=budget,
                      backend=cpu_backend, memory_margin=0.0)
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and "after margin" not in note[0], note  # the first plan fitted: not made again
    assert cached["bytes"] == 0
    engine.close()


@pytest.mark.parametrize("rate_checked", [False, True])
def test_rehearsing_leaves_training_exactly_as_without_it(cpu_backend, monkeypatch, rate_checked):
    """Same plan, with and without the rehearsal: every weight and moment equal after three
    clipped, decayed steps of two micro-batches. ``rate_checked``: the host-rate check is on
    (real devices; here its measurement is set to the plan's rate), so the rehearsal is
    ``RATE_STEPS`` steps."""
    x, y = batch()
    plan = free_plan(cpu_backend, 2)
    timed = []
    if rate_checked:
        rehearse_here(monkeypatch)
        monkeypatch.setattr(sum_placement, "WINDOW", -1.0)  # one plan timed: no device-summing rival rehearsed
        steps = []
        real_step = MemFerry.step
        monkeypatch.setattr(MemFerry, "step", lambda self: (steps.append(1), real_step(self))[1])
        planned = (plan.host_s_per_param - plan.host_earlier_s_per_param, plan.host_earlier_s_per_param)
        monkeypatch.setattr(HostOptimizer, "split_since", lambda self, start: (timed.append(len(steps)), planned)[1])
    out = []
    for rehearse in (True, False):
        engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5), plan=plan,
                          sample=(x, y), device_budget=int(plan.predicted_peak_bytes * 1.5), backend=cpu_backend,
                          accumulation_steps=2, rehearse=rehearse)
        assert any(n.startswith("rehearsal:") for n in engine.plan.notes) == rehearse
        # held to its prediction after the rehearsal (its peak is below it here), else to the budget
        held = cpu_backend.memory_cap(0)
        assert held == (plan.predicted_peak_bytes if rehearse else int(plan.predicted_peak_bytes * 1.5))
        for _ in range(3):
            for _ in range(2):
                engine.backward(model_loss(engine, x, y, labels_model=engine.model) / 2)
            engine.step()
        out.append(engine.state_dict())
        engine.close()
    (a, b) = out
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for name, st in a["optimizer"].items():
        assert all(torch.equal(st[k], b["optimizer"][name][k]) for k in ("master", "exp_avg", "exp_avg_sq")), name
        assert st["step"] == b["optimizer"][name]["step"] == 3
    assert timed == ([rehearsal.RATE_STEPS] if rate_checked else [])  # timed once, after its last step


def test_the_host_rate_is_timed_over_the_last_of_three_whole_steps(cpu_backend, monkeypatch):
    """With 3 micro-batches per step, the rate-checking rehearsal runs whole steps of 3 (two
    micro-batches would end a step early, which sums them before updating where the plan prices a
    step's last pair added by the update) and times from the second step's step() to the third's,
    comparing with the plan's rate for 3; without the check, one step of 2 shows the peak."""
    x, y = batch()
    plan = free_plan(cpu_backend, 3)
    rehearse_here(monkeypatch)
    monkeypatch.setattr(sum_placement, "WINDOW", -1.0)  # one plan timed: no device-summing rival rehearsed
    events: list[str] = []
    times: list[float] = []  # when each event's call returned

    def log(event, result=None):
        events.append(event)
        times.append(time.perf_counter())
        return result

    real_backward, real_step, real_counters = MemFerry.backward, MemFerry.step, HostOptimizer.counters
    monkeypatch.setattr(MemFerry, "backward", lambda self, loss: log("b", real_backward(self, loss)))
    monkeypatch.setattr(MemFerry, "step", lambda self: log("step", real_step(self)))
    monkeypatch.setattr(HostOptimizer, "counters", lambda self: log("start", real_counters(self)))
    planned = (plan.host_s_per_param - plan.host_earlier_s_per_param, plan.host_earlier_s_per_param)
    monkeypatch.setattr(HostOptimizer, "split_since", lambda self, start: log("rate", planned))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y),
                      device_budget=int(plan.predicted_peak_bytes * 1.5), backend=cpu_backend, accumulation_steps=3)
    assert rehearsal.RATE_STEPS == 3
    assert events == ["b", "b", "b", "step"] * 2 + ["start", "b", "b", "b", "step", "rate"]
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and note[0].startswith("rehearsal: 3 steps of 3 micro-batches at learning rate 0"), note
    said = [n for n in engine.plan.notes if n.startswith("host rate:")][0]
    # compared with the rate the plan assumed for its own steps of 3
    assert f"the {plan.host_s_per_param * 1e9:.3f} the plan assumed" in said and said.endswith("within the tolerance: same plan, not searched again)"), said
    # the last two steps on the wall clock, each at least from its first backward to its step()
    returned = [t for e, t in zip(events, times) if e in ("b", "step")]  # 3 steps of (3 backwards, step)
    spans = [returned[i + 3] - returned[i] for i in (4, 8)]
    assert rehearsal.CLOCKED_STEPS == 2
    assert engine.plan.rehearsed_step_s >= sum(spans) / 2 > 0 and plan.rehearsed_step_s is None
    stepped = [n for n in engine.plan.notes if n.startswith("rehearsal step:")]
    assert stepped == [f"rehearsal step: the last 2 took {engine.plan.rehearsed_step_s * 1e3:.1f} ms each on average "
                       f"against the {plan.predicted_step_s * 1e3:.1f} ms predicted "
                       f"({(plan.predicted_step_s - engine.plan.rehearsed_step_s) / engine.plan.rehearsed_step_s:+.1%})"]
    # and each of them on its own, with the training thread's waits for the host in it
    clocks = [n for n in engine.plan.notes if n.startswith("rehearsal clock")]
    assert len(clocks) == 1 and clocks[0].startswith("rehearsal clock 1: steps of "), clocks
    steps = [float(v) for v in clocks[0].split("steps of ")[1].split(" ms")[0].split(", ")]
    assert len(steps) == 2 and all(s >= span * 1e3 - 0.05 for s, span in zip(steps, spans)), (steps, spans)
    assert sum(steps) / 2 == pytest.approx(engine.plan.rehearsed_step_s * 1e3, abs=0.06)
    engine.close()


def test_the_rehearsal_clock_shows_a_step_held_by_the_host(cpu_backend, monkeypatch):
    """Each clocked rehearsal step's note says how long the training thread waited for the host
    optimizer in it: with every host update slowed by 0.4 s, the next forward waits for the first
    block's, in both clocked steps, and the host's work counts the updates' time."""
    x, y = batch()
    plan = free_plan(cpu_backend)  # both blocks host-updated
    monkeypatch.setattr(rehearsal, "applies", lambda backend: True)
    monkeypatch.setattr(rehearsal, "checked_plan", lambda *args, **kwargs: None)
    slow = 0.4
    real_update = HostOptimizer._update

    def slowed(self, index, coef, **kwargs):
        t0 = time.perf_counter()
        time.sleep(slow)
        self.time_s["adamw"] += time.perf_counter() - t0  # host work, as the kernel's time counts
        return real_update(self, index, coef, **kwargs)

    monkeypatch.setattr(HostOptimizer, "_update", slowed)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3, host_order="landing"), plan=plan, sample=(x, y),
                      device_budget=int(plan.predicted_peak_bytes * 1.5), backend=cpu_backend)
    note = [n for n in engine.plan.notes if n.startswith("rehearsal clock 1:")]
    assert len(note) == 1, engine.plan.notes
    figures = [[float(v) for v in part.split(" ms")[0].split(", ")]
               for part in note[0].replace("steps of ", "|").replace("waited ", "|").replace("took ", "|").split("|")[1:]]
    steps, waited, host = figures
    hosted = sum(u.optimizer == "host" for u in plan.units)
    assert len(steps) == len(waited) == len(host) == rehearsal.CLOCKED_STEPS
    assert all(w >= slow * 1e3 / 4 for w in waited), note  # the next forward waited on the host
    assert all(w <= s for w, s in zip(waited, steps)), note
    assert sum(host) >= slow * 1e3 * hosted, note  # the updates' sleeps, wherever each step's ended
    engine.close()


def test_the_rehearsal_step_holds_what_a_training_step_holds(cpu_backend):
    """Its peak is the peak of ``train_step`` (which keeps the loss through backward, as a loop
    that logs it does): a rehearsal that let the loss go peaked 4 bytes lower, and a plan held
    there ran out of memory in its first step."""
    x, y = batch()
    plan = free_plan(cpu_backend)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y),
                      device_budget=plan.predicted_peak_bytes * 2, backend=cpu_backend, rehearse=False)
    cpu_backend.set_memory_cap(0, None)
    rehearsed = rehearsal._rehearse(engine, (x, y))
    peak, allocated, rate, send_s, clock, alone, by_stream = rehearsed
    assert rate is None and rehearsed.step_s is None and send_s is None and clock == () and alone == () and peak >= allocated > 0
    assert by_stream == ""  # virtual devices keep no per-stream pools
    engine.synchronize()
    cpu_backend.reset_peak_memory(0)
    engine.train_step(x, y)
    engine.synchronize()
    assert cpu_backend.memory_stats(0).peak_allocated <= allocated
    engine.close()


def test_when_no_plan_fits_after_the_rehearsal_the_model_comes_back_unchanged(cpu_backend, monkeypatch,
                                                                              true_min_budget):
    _undercounting(monkeypatch, 0.6)
    model = qwen2_tied()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NoPlanFitsError, match="no plan fits a device budget"):
        MemFerry(model, optim=AdamW(lr=1e-3), plan="auto", sample=batch(), device_budget=true_min_budget,
                 backend=cpu_backend, memory_margin=0.0)
    assert cpu_backend.memory_cap(0) is None
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    x, y = batch()
    assert torch.isfinite(model_loss(model, x, y, labels_model=model))  # an ordinary host model again


@pytest.mark.parametrize("over", [False, True])
def test_the_allocator_is_held_to_the_prediction_not_to_what_the_uncapped_cache_kept(cpu_backend, monkeypatch,
                                                                                      over):
    """A rehearsal that reserved more than predicted (the cache, uncapped) but allocated less holds
    the allocator to the prediction; one that allocated more (the memory model missed) to the
    budget: a loop may hold a little more than the rehearsal did."""
    x, y = batch()
    plan = free_plan(cpu_backend)
    predicted = plan.predicted_peak_bytes
    allocated = predicted + (1 << 20) if over else predicted - (1 << 20)
    monkeypatch.setattr(rehearsal, "_rehearse",
                        lambda engine, sample, steps=1: rehearsal.Rehearsed(predicted + (2 << 20), allocated))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=predicted * 2,
                      backend=cpu_backend)
    assert cpu_backend.memory_cap(0) == (predicted * 2 if over else predicted)
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and " allocated, budget " in note[0], engine.plan.notes
    engine.close()


@pytest.mark.parametrize("first", ["prefetch+recompute", "prefetch+offload", "prefetch+selective", "dha"])
def test_a_rebuilt_engine_runs_its_own_plan_not_the_last_ones_wrappers(cpu_backend, monkeypatch, first):
    # A plan made again (margin, host rate, sum placement, an OOM) is built on the same blocks:
    # the last plan's recomputation, offload or DHA routing must not stay wrapped around them.
    import functools

    import strategies.memferry.executor as executor
    from strategies.memferry import Plan

    monkeypatch.setattr(executor, "DHA_LINEAR_MIN_BYTES", 0)  # this tiny model's linears streamed too
    model = qwen2_tied()
    layers = model.blocks
    theirs = functools.partial(layers[0].forward)  # another library's wrapper, there before us
    layers[0].forward = theirs
    linears = [m for b in layers for m in b.modules() if isinstance(m, torch.nn.Linear)]
    engine = MemFerry(model, optim=AdamW(lr=1e-3), plan=first, backend=cpu_backend)
    wrapped = [b for b in layers if "forward" in b.__dict__ and b.forward is not theirs]
    routed = [m for m in linears if "forward" in m.__dict__]
    assert (wrapped, routed) != ([], [])  # the first plan wrapped something
    rehearsal._rebuild(engine, Plan.from_spec("prefetch", len(layers)))
    assert layers[0].forward is theirs
    assert all("forward" not in b.__dict__ for b in layers[1:])
    assert all("forward" not in m.__dict__ for m in linears)
    rehearsal._rebuild(engine, Plan.from_spec("prefetch+recompute", len(layers)))
    inner = layers[1].forward.args[0]  # checkpoint(forward, ...): wrapped once, around the class's own
    assert getattr(inner, "__func__", None) is type(layers[1]).forward
    x, y = batch()
    assert float(engine.train_step(x, y)) > 0
    engine.close()
    assert layers[0].forward is theirs


@pytest.mark.parametrize("allocated_mib,held_mib", [(900, 999), (999, 999), (1000, 1500)])
def test_the_hold_leaves_room_for_what_the_allocator_may_pass_its_cap_by(allocated_mib, held_mib, cpu_backend,
                                                                         monkeypatch):
    # CUDA checks its fraction against the bytes asked, then maps whole 20 MiB pages: held at a
    # 1000 MiB prediction, a plan reserved a page's fraction over it (H200, session 24).
    import types

    MiB = 1 << 20
    monkeypatch.setattr(type(cpu_backend), "cap_overshoot", lambda self, device=None: MiB)
    engine = types.SimpleNamespace(backend=cpu_backend, device=0)
    held = rehearsal.hold_to_plan(engine, 1500 * MiB, 1000 * MiB, allocated_mib * MiB)
    assert held == held_mib * MiB == cpu_backend.memory_cap(0)
    cpu_backend.set_memory_cap(0, None)


def test_a_rehearsal_times_plain_steps_where_every_step_would_clip(cpu_backend):
    """The rehearsal runs one sample again and again, so a first norm over ``max_grad_norm``
    would clip all its steps, and they would be priced as plain ones (the 24-layer H100 row of
    2026-12-05 rehearsed 280 ms a step against its plain steps' 175). With a clip that fires on
    every real step, none of the rehearsal's steps clips, rolls back or stops speculating (the
    host's test for a step sure to clip), and the first training step after it clips again."""
    x, y = batch()
    plan = Plan.uniform(2, UnitPlan("prefetch", "prefetch"))  # both blocks host-updated
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3, max_grad_norm=1e-6), plan=plan, sample=(x, y),
                      device_budget=2**30, backend=cpu_backend, rehearse=False)
    cpu_backend.set_memory_cap(0, None)
    rehearsal._rehearse(engine, (x, y), timed=True)
    stats = engine.clip_stats()
    assert stats["steps"] == rehearsal.RATE_STEPS and stats["speculated_units"] > 0
    assert stats["rollback_steps"] == stats["sure_units"] == 0 and engine.clip.clipped_steps == 0
    engine.backward(model_loss(engine, x, y, labels_model=engine.model))
    engine.step()
    after = engine.clip_stats()
    assert engine.clip.clipped_steps == 1 and after["sure_units"] > 0  # sure after its first unit's norm
    engine.close()


def test_a_rebuild_frees_each_unit_before_it_copies_the_next(cpu_backend, monkeypatch):
    """A plan made again after its rehearsal is built from the engine's weights. Copied whole
    first, beside the whole shadow, they took a 6.6 B model's host past its cap (H100,
    2026-12-05). Taken unit by unit instead, each unit's host buffers are gone before the next
    unit's weights are copied, and the rebuilt engine holds the same fp32 weights."""
    x, y = batch()
    plan = Plan.uniform(2, UnitPlan("prefetch", "prefetch"))  # both blocks homed on the host
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=2**30,
                      backend=cpu_backend, rehearse=False, compute_dtype=torch.bfloat16)
    expected = engine.shadow.state_dict()
    host = [s.unit.index for s in engine.shadow.shadows if s.home == "host"]
    events = []
    for s in engine.shadow.shadows:
        if s.home == "host":
            weakref.finalize(s.master.untyped_storage(), events.append, ("freed", s.unit.index))
    del s  # the loop's last shadow would outlive the release
    real = ShadowModel._weights
    monkeypatch.setattr(ShadowModel, "_weights", lambda self, s, copy: (events.append(("copied", s.unit.index)),
                                                                        real(self, s, copy))[1])
    rehearsal._rebuild(engine, plan)
    copied = [e for e in events if e[1] in host]
    assert copied == [e for i in host for e in (("copied", i), ("freed", i))]
    got = engine.shadow.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[n], t) and got[n].dtype == t.dtype
                                             for n, t in expected.items())
    engine.close()


def test_what_the_uncapped_rehearsal_left_cached_is_given_back_once_the_cap_is_held(cpu_backend, monkeypatch):
    """The rehearsal runs with the cap lifted; blocks it left cached stayed reserved over the
    held cap through every step (11.0 GB reserved under a 10.6 GB hold, H100, 2026-12-05). The
    cache is given back after the hold, nothing capped after that."""
    x, y = batch()
    plan = free_plan(cpu_backend)
    calls = []
    real_cap = cpu_backend.set_memory_cap
    monkeypatch.setattr(cpu_backend, "set_memory_cap", lambda d, n: (calls.append(("cap", n)), real_cap(d, n))[1])
    monkeypatch.setattr(cpu_backend, "release_cache", lambda device=None: calls.append(("release", None)))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y),
                      device_budget=int(plan.predicted_peak_bytes * 1.5), backend=cpu_backend)
    assert any(n.startswith("rehearsal:") for n in engine.plan.notes)
    assert calls[-2:] == [("cap", plan.predicted_peak_bytes), ("release", None)]  # held to the prediction, then given back
    engine.close()


def test_a_clocked_step_that_a_full_collection_paused_says_so(cpu_backend, monkeypatch):
    """A full garbage collection in the rehearsal's third step (the one whose host work is read)
    counts in that step's clock and its note; none in the second, and no word where none ran.
    Python's own collections are off meanwhile: only the one made here runs."""
    import gc

    x, y = batch()
    plan = free_plan(cpu_backend)
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y),
                      device_budget=plan.predicted_peak_bytes * 2, backend=cpu_backend, rehearse=False)
    cpu_backend.set_memory_cap(0, None)
    steps = []
    real_step = MemFerry.step

    def step(self):
        real_step(self)
        steps.append(1)
        if len(steps) == rehearsal.RATE_STEPS:
            gc.collect()

    monkeypatch.setattr(MemFerry, "step", step)
    monkeypatch.setattr(rehearsal_steps, "GC_PAUSE_S", 1e-9)  # any full collection is worth the word here
    gc.disable()
    try:
        clock = rehearsal._rehearse(engine, (x, y), timed=True).clock
    finally:
        gc.enable()
    assert len(clock) == 2 and clock[0].gc_s == 0.0 and clock[1].gc_s > 0.0, clock
    note = rehearsal.clock_note(1, clock)
    assert note.endswith(f"; Python's full garbage collections took 0.0, {clock[1].gc_s * 1e3:.1f} ms of them"), note
    assert "garbage" not in rehearsal.clock_note(1, tuple(c._replace(gc_s=0.0) for c in clock))
    engine.close()
