"""A rehearsal over its budget only by what the uncapped cache kept (``rehearsal.confirm_under_cap``):
one more step under the cap the plan will be held to decides, instead of a plan made again.

The cpu backend's virtual devices reserve what they allocate; a caching allocator is faked by
reporting, while the cap is lifted, a reserved peak above the budget beside the true allocated
peak."""
from __future__ import annotations

import copy
import dataclasses
import logging
import re

import torch

import strategies.memferry.rehearsal as rehearsal
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.planning import plan_for
from tests.test_memferry_scheduler_accum import batch, qwen2_tied

MB = 1 << 20


def _uncapped_cache(monkeypatch, backend, over: int) -> None:
    """While no cap is set, the reserved peak reads ``over`` bytes above the cap's budget."""
    real = type(backend).memory_stats
    budget = {}

    def stats(self, device=None):
        s = real(self, device)
        if self.memory_cap(device) is None and "bytes" in budget:
            return dataclasses.replace(s, peak_reserved=max(s.peak_reserved, budget["bytes"] + over))
        return s

    monkeypatch.setattr(type(backend), "memory_stats", stats)
    real_cap = type(backend).set_memory_cap

    def set_cap(self, device, nbytes):
        if nbytes is not None and "bytes" not in budget:
            budget["bytes"] = nbytes  # the first cap set is the budget (MemFerry sets it before rehearsing)
        real_cap(self, device, nbytes)

    monkeypatch.setattr(type(backend), "set_memory_cap", set_cap)


def test_a_plan_over_only_by_its_uncapped_cache_is_kept_once_a_held_step_fits(cpu_backend, monkeypatch):
    x, y = batch()
    plan = plan_for(qwen2_tied(), (x, y), None, backend=cpu_backend, memory_margin=0.0)
    budget = int(plan.predicted_peak_bytes * 1.2)
    _uncapped_cache(monkeypatch, cpu_backend, 64 * MB)
    calls = []
    real = rehearsal._rehearse
    monkeypatch.setattr(rehearsal, "_rehearse", lambda engine, sample, timed=False: (
        calls.append(cpu_backend.memory_cap(0)), real(engine, sample, timed))[1])
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                      backend=cpu_backend)
    # Uncapped first, then once held to the prediction (allocated below it): the given plan is kept.
    assert calls == [None, plan.predicted_peak_bytes]
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and "after margin" not in note[0], note
    assert f"one step held to {rehearsal.format_bytes(plan.predicted_peak_bytes)} reserved " in note[0], note[0]
    assert "uncapped it reserved " in note[0] and "0 allocator retries" in note[0], note[0]
    assert cpu_backend.memory_cap(0) == plan.predicted_peak_bytes
    cpu_backend.reset_peak_memory(0)
    engine.train_step(x, y)
    assert cpu_backend.memory_stats(0).peak_allocated <= plan.predicted_peak_bytes
    engine.close()


def test_a_held_step_that_runs_out_of_memory_makes_the_plan_again_from_unchanged_weights(cpu_backend, monkeypatch,
                                                                                         caplog):
    """The held step fails in its middle (its hold faked too low); the plan is made again, as
    for any overshoot (here: the same layout, whose held step then fits), and the engine's
    weights are still the model's."""
    x, y = batch()
    model = qwen2_tied()
    before = copy.deepcopy(model.state_dict())
    plan = plan_for(qwen2_tied(), (x, y), None, backend=cpu_backend, memory_margin=0.0)
    budget = int(plan.predicted_peak_bytes * 1.2)
    _uncapped_cache(monkeypatch, cpu_backend, 64 * MB)
    real_hold = rehearsal.hold_to_plan
    holds = []

    def hold(engine, budget, predicted, allocated):
        if not holds:  # the confirming step's hold: half its allocated peak, so it runs out mid-step
            holds.append(allocated // 2)
            engine.backend.set_memory_cap(engine.device, allocated // 2)
            return allocated // 2
        holds.append(real_hold(engine, budget, predicted, allocated))
        return holds[-1]

    monkeypatch.setattr(rehearsal, "hold_to_plan", hold)
    monkeypatch.setattr(rehearsal, "replan", lambda plan, *a, **k: dataclasses.replace(plan))  # the same layout again
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        engine = MemFerry(model, optim=AdamW(lr=1e-3), plan=plan, sample=(x, y), device_budget=budget,
                          backend=cpu_backend)
    said = [r.getMessage() for r in caplog.records if "it ran out of memory" in r.getMessage()]
    assert len(said) == 1 and " uncapped and allocated " in said[0] and "; held to " in said[0], said
    note = [n for n in engine.plan.notes if n.startswith("rehearsal:")]
    assert len(note) == 1 and re.search(r"\(after margin \d+% peaked at", note[0]) and "one step held to" in note[0], note
    got = engine.shadow.state_dict()
    assert got and set(got) <= set(before) and all(torch.equal(v, before[k]) for k, v in got.items())  # tied: once
    cpu_backend.reset_peak_memory(0)
    engine.train_step(x, y)
    assert cpu_backend.memory_stats(0).peak_allocated <= budget
    engine.close()
