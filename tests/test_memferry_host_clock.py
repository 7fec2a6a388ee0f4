"""The host optimizer's clock (``host_clock.py``): the sums of a step's earlier micro-batches
are kept apart from the work once the last gradient has landed, so that the rehearsal can
calibrate each part of the cost model on its own (``host_calibration.py``)."""
from __future__ import annotations

import time

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.host_clock import HostClock, HostReading
from strategies.memferry.host_kernel import PHASES
from strategies.memferry.landing_zones import LandingZones
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss


def test_earlier_sums_are_kept_apart_and_updates_under_way_left_out():
    clock = HostClock()
    clock.add_sum(0.5, earlier=True)
    clock.add_sum(0.25, earlier=False)  # the step's last micro-batch: part of the update's work
    start = clock.reading()
    assert start == (0.75, 0, 0.5)
    clock.count(3, {"adamw": 1.0}, done=False, numel=10)  # a piece of an update under way
    assert clock.reading() == start
    clock.count(3, {"adamw": 2.0, "writeback": 0.5}, done=True, numel=10)
    clock.add_sum(0.125, earlier=True)
    assert clock.since(start) == (3.625, 10, 0.125)
    assert clock.time_s["upcast"] == 0.875 and clock.time_s["adamw"] == 3.0
    clock.reset()
    assert clock.reading() == (0.0, 0, 0.0) and clock.time_s["upcast"] == 0.0


def test_an_accumulated_step_s_host_work_splits_into_its_sums_and_its_updates(cpu_backend, monkeypatch):
    real = LandingZones.receive

    def receive(self, index, final, summed, zone):  # each sum "takes" 1 s, or 10 s for a step's last
        real(self, index, final, summed, zone)
        return 10.0 if final else 1.0

    monkeypatch.setattr(LandingZones, "receive", receive)
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, host_kernel="single-pass"),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss,
                      accumulation_steps=3)
    data = batches(6)
    for step in range(2):
        for x, y in data[3 * step:3 * step + 3]:
            engine.backward(lm_loss(engine(x), y) / 3)
        engine.step()
    opt = engine.optimizer
    opt.wait_all()
    units = len(opt.shadows)  # four blocks and rest, all updated on the host
    assert opt.clock.earlier_s == 2 * 2 * units * 1.0  # two steps, two earlier micro-batches each
    assert opt.time_s["upcast"] == 2 * 2 * units * 1.0 + 2 * units * 10.0
    update, earlier = opt.split_since(HostReading(0.0, 0, 0.0))
    numel = opt.updated_numel
    assert numel == 2 * sum(s.master.numel() for s in opt.shadows)
    assert earlier == pytest.approx(4 * units / numel)
    assert update == pytest.approx(opt.measured_s_per_param() - earlier) and update > 20 * units / numel
    engine.close()


def test_the_worker_s_idle_wait_is_read_apart_from_its_work(cpu_backend):
    """While nothing is queued the worker blocks for the next task; that time is ``idle`` (the
    bubbles of a host-bound step), never host work (the cost model's calibration reads work)."""
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, host_kernel="single-pass"),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss)
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    opt = engine.optimizer
    opt.wait_all()  # every update done: the worker waits for the next step's first gradient
    idle = opt.time_s["idle"]
    time.sleep(0.5)
    engine.backward(lm_loss(engine(x2), y2))
    engine.step()
    opt.wait_all()
    assert opt.time_s["idle"] - idle >= 0.25  # the half second it was blocked (less what it took to get there)
    assert "idle" not in PHASES and opt.clock.work_s() == pytest.approx(sum(opt.time_s[p] for p in PHASES))
    engine.close()


def test_the_sums_calls_beyond_their_loops_read_as_call_not_upcast(cpu_backend, monkeypatch):
    """A sum's loop is clocked inside its C call; what the call takes beyond it moves from
    ``upcast`` to ``call``, the work and the earlier micro-batches' seconds unchanged."""
    from strategies.memferry import host_loops

    calls = []
    real = {name: getattr(host_loops.HostLoops, name) for name in ("accumulate", "accumulate_pair")}

    def slowed(name):
        def run(self, *a, **kw):  # the real loop, then 20 ms outside it, reporting no time inside
            real[name](self, *a, **kw)
            time.sleep(0.02)
            calls.append(name)
            return 0.0
        return run

    for name in real:
        monkeypatch.setattr(host_loops.HostLoops, name, slowed(name))
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, host_kernel="single-pass"),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss,
                      accumulation_steps=4, compute_dtype=torch.bfloat16)  # 16-bit gradients: the loops sum them
    for x, y in batches(4):
        engine.backward(lm_loss(engine(x), y) / 4)
    engine.step()
    opt = engine.optimizer
    opt.wait_all()
    assert calls  # the step's sums ran through the loops
    assert opt.time_s["call"] >= 0.02 * len(calls) - 1e-9
    assert opt.clock.earlier_s >= 0.02 * 5 - 1e-9  # 5 units' first pair, summed early: kept whole
    assert opt.clock.work_s() == pytest.approx(sum(opt.time_s[p] for p in PHASES))
    engine.close()


def test_moving_sums_calls_keeps_the_work_and_earlier_seconds():
    clock = HostClock()
    clock.add_sum(0.5, earlier=True)
    clock.sums_called(0.125)
    assert clock.time_s["upcast"] == 0.375 and clock.time_s["call"] == 0.125
    assert clock.work_s() == 0.5 and clock.earlier_s == 0.5
