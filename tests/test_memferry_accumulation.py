"""Gradient accumulation: N backward() calls then one step() is ONE torch AdamW step on the summed gradients."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.accumulation import AccumulationError
from strategies.weight_decay import param_groups
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss

PLANS = {
    "prefetch": lambda n: Plan.uniform(n, UnitPlan("prefetch", "prefetch")),
    "dha": lambda n: Plan.uniform(n, UnitPlan("dha", "dha")),
    # every block's weights on the device, updated on the host: reloaded once a step, after it
    "resident": lambda n: Plan.from_spec(f"resident{n}", n),
    "device": lambda n: Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch"),
                              UnitPlan("resident", "resident", recompute=True, optimizer="device"),
                              UnitPlan("dha", "prefetch", recompute=True)], rest_optimizer="device"),
}


def reference(model, steps, cfg, n):
    """Plain torch AdamW, one step per ``n`` micro-batches, on the summed gradients of ``loss / n``."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    for micro in steps:
        opt.zero_grad()
        for x, y in micro:
            (lm_loss(model(x), y) / n).backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run_engine(model, steps, cfg, plan, backend, n, accumulation_steps=None):
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=backend, loss_fn=lm_loss,
                      accumulation_steps=accumulation_steps or n)
    for micro in steps:
        for x, y in micro:
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / n)
        engine.step()
    out = engine.state_dict()
    engine.close()
    return engine, out


def _setup(n, n_steps=3):
    torch.manual_seed(0)
    model = TinyGPT()
    data = batches(n * n_steps)
    return model, [data[i * n:(i + 1) * n] for i in range(n_steps)]


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_accumulation_equals_adamw_on_summed_gradients(cpu_backend, plan_name, clip):
    if plan_name == "dha" and not cpu_backend.caps.dha:
        pytest.skip("no DHA on this backend")
    model, steps = _setup(4)
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref = reference(model, steps, cfg, 4)
    engine, state = run_engine(model, steps, cfg, PLANS[plan_name](4), cpu_backend, 4)
    for name, p in ref.items():
        torch.testing.assert_close(state["model"][name], p, atol=1e-6, rtol=1e-6, msg=name)
    assert {v["step"] for v in state["optimizer"].values()} == {3}
    if clip is not None:
        assert engine.last_grad_norm > clip  # the clip was active: the norm is the accumulated one


@pytest.mark.parametrize("clip", [None, 0.05])
def test_step_after_fewer_backwards_applies_accumulated(cpu_backend, clip):
    model, steps = _setup(2)
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    ref = reference(model, steps, cfg, 2)
    _, state = run_engine(model, steps, cfg, PLANS["prefetch"](4), cpu_backend, 2, accumulation_steps=4)
    for name, p in ref.items():
        torch.testing.assert_close(state["model"][name], p, atol=1e-6, rtol=1e-6, msg=name)


def _summing(accumulate):
    """Resident and prefetched (recomputed) host-updated blocks summing on ``accumulate``, beside a
    device-homed block and a host-summed one, for the bit-equality check."""
    return Plan([UnitPlan("resident", "resident", accumulate=accumulate),
                 UnitPlan("prefetch", "prefetch", recompute=True, accumulate=accumulate),
                 UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_device_summing_is_bit_equal_to_host_summing(cpu_backend, dtype, clip):
    """``UnitPlan(accumulate="device")`` against the same plan summing on the host: two steps of 3
    micro-batches and one ended early after 2 (the flush path) leave every weight, master and
    moment bit-equal; the summed units sent home one fp32 gradient per step instead of one per
    micro-batch."""
    torch.manual_seed(0)
    model, data = TinyGPT(), batches(8)
    steps = [data[0:3], data[3:6], data[6:8]]
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    held, sent = {}, {}
    for acc in ("host", "device"):
        engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=_summing(acc), backend=cpu_backend, loss_fn=lm_loss,
                          accumulation_steps=3, compute_dtype=dtype)
        for micro in steps:
            for x, y in micro:
                engine.backward(lm_loss(engine(x), engine._to_device(y)) / 3)
            engine.step()
        engine.synchronize()
        held[acc] = [t.clone() for s in engine.shadow.shadows for t in (s.work, s.master, s.exp_avg, s.exp_avg_sq)]
        sent[acc] = engine.executor.bytes_d2h
        summed = sum(s.unit.train_numel for s in engine.shadow.shadows[:2])
        assert {s.step for s in engine.shadow.shadows} == {3}
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(held["host"], held["device"]))
    g = torch.finfo(dtype).bits // 8
    assert sent["host"] - sent["device"] == summed * sum(len(m) * g - 4 for m in steps)


def test_device_summing_needs_accumulation_and_a_host_unit(cpu_backend):
    with pytest.raises(ValueError, match=r"^block 0: accumulate='device' .* accumulation_steps is 1: give "):
        MemFerry(TinyGPT(), plan=_summing("device"), backend=cpu_backend)
    with pytest.raises(ValueError, match="accumulate='device' is for host-updated units without DHA"):
        UnitPlan("dha", "dha", accumulate="device")
    with pytest.raises(ValueError, match="accumulate='device' is for host-updated units without DHA"):
        UnitPlan("resident", "resident", optimizer="device", accumulate="device")
    with pytest.raises(ValueError, match="DHA blocks cannot"):
        Plan.from_spec("dha+devacc", 4)
    plan = Plan.from_spec("device1+recompute+devacc", 3)
    assert [u.accumulate for u in plan.units] == ["host", "device", "device"] and plan.units[1].recompute
    assert "accumulate=device" in plan.describe().splitlines()[1]


def test_second_micro_batch_forward_completes_with_clipping(cpu_backend):
    # Held (clipped) updates used to make the next micro-batch's forward wait forever.
    model, steps = _setup(2, 1)
    engine = MemFerry(model, optim=AdamW(max_grad_norm=1.0), plan=PLANS["prefetch"](4), backend=cpu_backend,
                      accumulation_steps=2)
    (x0, y0), (x1, y1) = steps[0]
    engine.backward(lm_loss(engine(x0), engine._to_device(y0)))
    out = engine(x1)
    assert out.shape == (4, 16, 64)
    engine.backward(lm_loss(out, engine._to_device(y1)))
    engine.step()
    engine.synchronize()
    assert {s.step for s in engine.shadow.shadows} == {1}
    engine.close()


def _engine(cpu_backend, n=2):
    torch.manual_seed(0)
    return MemFerry(TinyGPT(), plan=PLANS["prefetch"](4), backend=cpu_backend, accumulation_steps=n)


def test_forward_twice_without_backward_is_refused(cpu_backend):
    engine = _engine(cpu_backend)
    x, y = batches(1)[0]
    engine(x)
    with pytest.raises(AccumulationError, match="forward ran twice without backward"):
        engine(x)
    with torch.no_grad():
        engine(x)  # evaluation forwards are fine
    engine.close()


def test_step_with_nothing_accumulated_is_refused(cpu_backend):
    engine = _engine(cpu_backend)
    with pytest.raises(AccumulationError, match="step\\(\\) with no gradient accumulated"):
        engine.step()
    assert {s.step for s in engine.shadow.shadows} == {0}
    engine.close()


def test_more_backwards_than_declared_is_refused(cpu_backend):
    engine = _engine(cpu_backend, n=1)
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), engine._to_device(y))
    engine.backward(loss)
    with pytest.raises(AccumulationError, match="call engine.step\\(\\) before the next forward"):
        engine(x)
    with pytest.raises(AccumulationError, match="accumulation_steps=1: call engine.step"):
        engine.backward(loss)
    engine.step()
    engine.synchronize()
    assert {s.step for s in engine.shadow.shadows} == {1}  # one update, not two
    engine.close()


def test_unaccumulated_backwards_do_not_update(cpu_backend):
    engine = _engine(cpu_backend, n=3)
    for x, y in batches(3):
        before = engine.state_dict()["model"]
        engine.backward(lm_loss(engine(x), engine._to_device(y)))
        if engine.micro.backwards < 3:
            after = engine.state_dict()["model"]
            assert all(torch.equal(before[k], after[k]) for k in before)
    engine.step()
    engine.synchronize()
    assert {s.step for s in engine.shadow.shadows} == {1}
    engine.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_accumulation_steps(cpu_backend, bad):
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        MemFerry(TinyGPT(), backend=cpu_backend, accumulation_steps=bad)


def _dp_rank(rank, port, out_dir):
    import os

    import torch.distributed as dist

    os.environ.update(XPU_BACKEND="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import xpu
    from xpu.dist import leave_rank

    xpu.reset_backend()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    plan = Plan.from_spec("device2+recompute", 4)
    plan.units[3] = UnitPlan("prefetch", "prefetch", recompute=True, accumulate="device")  # one averaged fp32 sum a step
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.05),
                      plan=plan, loss_fn=lm_loss, device=rank, accumulation_steps=2)
    for x, y in batches(3):  # 4 samples a step: 2 per rank, 1 per micro-batch
        for m in range(2):
            i = 2 * rank + m
            engine.backward(lm_loss(engine(x[i:i + 1]), engine._to_device(y[i:i + 1])) / 2)
        engine.step()
    state = engine.state_dict()
    engine.close()
    torch.save(state["model"], f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)  # see xpu.dist.leave_rank: a torch thread alive at shutdown can abort the rank


def test_accumulation_under_data_parallelism(tmp_path, cpu_backend):
    import torch.multiprocessing as mp

    from xpu.dist import free_port

    torch.manual_seed(0)
    model = TinyGPT()
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.05)
    ref = reference(model, [[b] for b in batches(3)], cfg, 1)  # the whole batch at once
    mp.spawn(_dp_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        state = torch.load(tmp_path / f"rank{r}.pt")
        for name, p in ref.items():
            torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)
