"""MemFerry's plan="auto" end to end on the cpu backend: the engine profiles, schedules and
trains exactly; plan_for plans apart from the engine; what the plan assumed (device-homed bytes,
the host rate, the device the host thread binds) is what the engine then holds and checks."""
from __future__ import annotations

import pytest
import torch

from strategies.memferry.config import Plan
from strategies.memferry.scheduler import schedule
from tests.test_memferry_scheduler import GB, H200_LINKS, L, h200_profile


def test_device_homed_bytes_match_what_the_engine_holds(cpu_backend):
    """The cost model's per-parameter device bytes are what ShadowModel really keeps between steps."""
    import torch

    from strategies.models import build_model
    from strategies.memferry import MemFerry
    from strategies.memferry.cost import device_bytes_per_param

    torch.manual_seed(0)
    model = build_model("gpt", layers=3, hidden=64, heads=4, vocab=128, seq=32)
    homed = sum(p.numel() for b in model.blocks[:2] for p in b.parameters())
    homed += sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    engine = MemFerry(model, plan=Plan.from_spec("device2", 3), backend=cpu_backend)
    x = torch.randint(0, 128, (2, 32))
    engine.train_step(x, x)
    engine.synchronize()
    held = cpu_backend.memory_stats(engine.device).allocated
    engine.close()
    assert held == homed * device_bytes_per_param(4)  # fp32: master is the weights, plus two moments


def test_auto_plan_profiles_schedules_and_trains_exactly(cpu_backend, caplog):
    """plan="auto": the engine profiles a step, the scheduler picks a plan under the budget, and
    training with it still matches plain PyTorch AdamW."""
    import logging

    import torch

    from strategies.models import build_model
    from strategies.memferry import AdamW, MemFerry
    from test_memferry_numerics import reference_self_loss

    torch.manual_seed(0)
    model = build_model("gpt", layers=3, hidden=64, heads=4, vocab=128, seq=32)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 128, (2, 32), generator=g), torch.randint(0, 128, (2, 32), generator=g)) for _ in range(3)]
    ref_losses, _ = reference_self_loss(model, data, AdamW(lr=1e-3, weight_decay=0.0))
    with caplog.at_level(logging.INFO, logger="xpu.memferry"):
        engine = MemFerry(model, optim=AdamW(lr=1e-3, weight_decay=0.0), plan="auto", sample=data[0],
                          device_budget="64MB", backend=cpu_backend)
    assert "MemFerry plan for GPT" in caplog.text and engine.plan.predicted_step_s is not None
    losses = [engine.train_step(x, y).item() for x, y in data]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    with pytest.raises(ValueError, match="pass sample="):
        MemFerry(build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=8), plan="auto", backend=cpu_backend)


def test_plan_for_plans_apart_from_the_engine_and_leaves_the_model_as_it_came(cpu_backend):
    """plan_for (profiler -> scheduler) gives a Plan the engine then runs as given; with
    compute_dtype the model is profiled cast and handed back in fp32."""
    from strategies.models import build_model
    from strategies.memferry import AdamW, MemFerry, Plan, plan_for
    from test_memferry_numerics import reference_self_loss

    torch.manual_seed(0)
    model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(2)]
    cfg = AdamW(lr=1e-3, weight_decay=0.0)
    ref_losses, _ = reference_self_loss(model, data, cfg)
    plan = plan_for(model, data[0], "64MB", optim=cfg, backend=cpu_backend, compute_dtype=torch.bfloat16)
    assert isinstance(plan, Plan) and plan.predicted_step_s is not None and len(plan.units) == 2
    assert [n for n in plan.notes if n.startswith("setup: profiled one step in ")]  # where setup time went
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    plan = plan_for(model, data[0], "64MB", optim=cfg, backend=cpu_backend)
    engine = MemFerry(model, optim=cfg, plan=plan, device_budget="64MB", backend=cpu_backend)
    assert [n for n in engine.plan.notes if n.startswith("setup: made the shadow model in ")]
    assert engine.plan is plan
    losses = [engine.train_step(x, y).item() for x, y in data]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    with pytest.raises(ValueError, match="pass sample="):
        plan_for(model, None, backend=cpu_backend)


def test_auto_plan_under_a_cap_set_beforehand_profiles_within_it(cpu_backend):
    """The harness caps the device before the engine exists: the profiler's device-AdamW rate
    measurement must size itself to what the cap leaves (it once asked for 20 MB under 12)."""
    from strategies.models import build_model
    from strategies.memferry import AdamW, MemFerry

    torch.manual_seed(0)
    model = build_model("gpt", layers=1, hidden=128, heads=4, vocab=512, seq=64)
    model.loss_chunks = 8
    tok = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(0))
    x, y = tok[:, :-1], tok[:, 1:]
    cap = 12_000_000
    cpu_backend.set_memory_cap(0, cap)
    try:
        engine = MemFerry(model, optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=cap,
                          memory_margin=0.05, backend=cpu_backend, blocks=model.blocks)
        losses = [float(engine.train_step(x, y)) for _ in range(3)]
        engine.close()
    finally:
        cpu_backend.set_memory_cap(0, None)
    assert losses[-1] < losses[0]


def test_the_plan_keeps_the_host_rate_it_assumed_and_the_engine_warns_when_steps_run_far_from_it(cpu_backend, caplog):
    """The scheduler records the profiled host AdamW rate in the plan; after a few steps the
    engine compares it with the rate its updates measured and says so when they differ by
    more than 25 % and that difference, over a step's host parameters, is at least 5 % of the
    predicted step (the prediction is then off by up to that much host work)."""
    import logging

    from strategies.models import build_model
    from strategies.memferry import AdamW, MemFerry
    from strategies.memferry.engine import _RATE_CHECK_STEP

    prof = h200_profile()
    plan = schedule(prof, H200_LINKS, 17.7 * GB, L, allow_dha=False, depths=(1,), explain=False)
    assert plan.host_s_per_param == prof.host_adamw_s_per_param

    def train(planned_factor, then=None):
        torch.manual_seed(0)
        model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)
        tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
        engine = MemFerry(model, optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend, blocks=model.blocks)
        assert engine.host_rate() == (None, None)  # nothing updated yet; a named plan assumed no rate
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
            for i in range(_RATE_CHECK_STEP):
                if i == _RATE_CHECK_STEP - 1:  # the updates of the earlier steps are done: plan "around" them
                    engine.synchronize()
                    engine.plan.host_s_per_param = engine.optimizer.measured_s_per_param() * planned_factor
                engine.train_step(tok[:, :-1], tok[:, 1:])
        engine.synchronize()
        measured, planned = engine.host_rate()
        assert measured > 0 and engine.optimizer.updated_numel == _RATE_CHECK_STEP * sum(
            p.numel() for p in model.parameters())
        text = caplog.text
        if then is not None:
            text = then(engine, measured)
        engine.close()
        return text

    assert "optimistic" in train(0.1)  # planned 10x faster than the steps ran
    assert "pessimistic" in train(10.0)

    def check_at(factor, share=None):
        """The threshold alone, on a settled measurement (no timing noise); ``share``: the
        predicted step set so the rates' difference over a step's parameters is that share of it."""
        def then(engine, measured):
            engine.plan.host_s_per_param = measured * factor
            if share is not None:
                per_step = sum(p.numel() for p in engine.model.parameters())
                engine.plan.predicted_step_s = abs(1 - factor) * measured * per_step / share
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
                engine._check_host_rate()
            return caplog.text
        return then

    assert "host optimizer ran" not in train(1.0, check_at(1.0))
    assert "host optimizer ran" not in train(1.0, check_at(1 / 1.2))
    assert "optimistic" in train(1.0, check_at(1 / 1.3))
    # 10x slower than planned: warned only where that moves the predicted step by 5 % or more
    assert "host optimizer ran" not in train(1.0, check_at(0.1, share=0.04))
    text = train(1.0, check_at(0.1, share=0.06))
    assert "optimistic" in text and "ms a step more" in text


def test_the_host_optimizer_thread_binds_the_engine_s_device_first(cpu_backend, monkeypatch):
    """A new thread starts on device 0: the host optimizer's worker binds the engine's device
    before it waits on any event (else every rank's process opens a context on device 0)."""
    import threading

    from strategies.models import build_model
    from strategies.memferry import AdamW, MemFerry

    bound = []
    real = cpu_backend.bind_process
    monkeypatch.setattr(cpu_backend, "bind_process",
                        lambda index: bound.append((threading.current_thread().name, index)) or real(index))
    torch.manual_seed(0)
    model = build_model("gpt", layers=1, hidden=32, heads=2, vocab=64, seq=16)
    tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    engine = MemFerry(model, optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend, device=1, blocks=model.blocks)
    engine.train_step(tok[:, :-1], tok[:, 1:])
    engine.close()
    assert ("memferry-host-adamw", 1) in bound
