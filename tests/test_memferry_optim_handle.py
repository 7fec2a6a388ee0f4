"""engine.as_torch_optimizer(): torch's LR schedulers drive MemFerry exactly as they drive torch AdamW."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.weight_decay import param_groups
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss


def warmup(step):
    return min(1.0, (step + 1) / 3)


@pytest.mark.parametrize("plan, clip, n", [("prefetch", None, 1), ("device", 0.05, 2)])
def test_lambda_lr_drives_the_engine(cpu_backend, plan, clip, n):
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    data = batches(4 * n)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for i in range(4):
        opt.zero_grad()
        for x, y in data[i * n:(i + 1) * n]:
            (lm_loss(ref(x), y) / n).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        sched.step()
    p = (Plan.uniform(4, UnitPlan("prefetch", "prefetch")) if plan == "prefetch" else
         Plan([UnitPlan("resident", "resident", optimizer="device")] * 2 + [UnitPlan("prefetch", "prefetch")] * 2,
              rest_optimizer="device"))
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=p, backend=cpu_backend, accumulation_steps=n)
    handle = engine.as_torch_optimizer()
    assert isinstance(handle, torch.optim.Optimizer) and len(handle.param_groups) == 2
    assert handle.param_groups[1]["weight_decay"] == 0.0
    esched = torch.optim.lr_scheduler.LambdaLR(handle, warmup)
    for i in range(4):
        handle.zero_grad()
        for x, y in data[i * n:(i + 1) * n]:
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / n)
        handle.step()
        esched.step()
    assert esched.get_last_lr() == sched.get_last_lr()
    state = engine.state_dict()["model"]
    saved = handle.state_dict()
    assert set(saved["state"]) == {name for name, _ in model.named_parameters()}
    handle.load_state_dict(saved)
    engine.close()
    for name, q in ref.named_parameters():
        torch.testing.assert_close(state[name], q.detach(), atol=1e-6, rtol=1e-6, msg=name)


def test_differing_group_rates_are_refused(cpu_backend):
    engine = MemFerry(TinyGPT(), backend=cpu_backend, plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")))
    handle = engine.as_torch_optimizer()
    handle.param_groups[1]["lr"] = 1.0
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), engine._to_device(y))
    with pytest.raises(ValueError, match="one learning rate"):
        engine.backward(loss)
    engine.close()
