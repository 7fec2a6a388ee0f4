"""Frozen parameters and weight-decay groups: MemFerry equals torch AdamW over the trainable parameters only."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan, split_units
from strategies.memferry.shadow_sizing import host_bytes_needed
from strategies.weight_decay import no_decay_names, param_groups
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss

PLANS = {
    "prefetch": lambda n: Plan.uniform(n, UnitPlan("prefetch", "prefetch")),
    "dha": lambda n: Plan.uniform(n, UnitPlan("dha", "dha")),
    "device": lambda n: Plan([UnitPlan("resident", "resident", optimizer="device"),
                              UnitPlan("resident", "resident", optimizer="device"),
                              UnitPlan("prefetch", "prefetch", recompute=True), UnitPlan("dha", "dha")],
                             rest_optimizer="device"),
}


def frozen_model():
    """Block 1 wholly frozen, block 2 partly (attention and a norm), the embedding frozen."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.blocks[1].requires_grad_(False)
    for p in (model.blocks[2].qkv.weight, model.blocks[2].ln.weight, model.blocks[2].ln.bias, model.emb.weight):
        p.requires_grad_(False)
    return model


def reference(model, data, cfg, groups):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    for x, y in data:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run(model, data, cfg, plan, backend, **kw):
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=backend, loss_fn=lm_loss, **kw)
    for x, y in data:
        engine.train_step(x, y)
    state = engine.state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_frozen_blocks_equal_adamw_over_trainable(cpu_backend, plan_name, clip):
    if plan_name != "prefetch" and clip is not None:
        pytest.skip("clipping is covered on one plan")
    if plan_name == "dha" and not cpu_backend.caps.dha:
        pytest.skip("no DHA on this backend")
    model = frozen_model()
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    data = batches(3)
    ref = reference(model, data, cfg, lambda m: param_groups(m, cfg.weight_decay))
    state = run(model, data, cfg, PLANS[plan_name](4), cpu_backend)
    for name, p in ref.items():
        torch.testing.assert_close(state["model"][name], p, atol=1e-6, rtol=1e-6, msg=name)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for name in frozen:
        assert torch.equal(state["model"][name], dict(model.named_parameters())[name].detach()), name
    assert set(state["optimizer"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert {v["step"] for v in state["optimizer"].values()} == {3}


def test_frozen_with_accumulation(cpu_backend):
    model = frozen_model()
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(4)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref_model, 0.1), lr=cfg.lr)
    for x, y in data:
        (lm_loss(ref_model(x), y) / 4).backward()
    opt.step()
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=PLANS["prefetch"](4), backend=cpu_backend,
                      accumulation_steps=4)
    for x, y in data:
        engine.backward(lm_loss(engine(x), engine._to_device(y)) / 4)
    engine.step()
    state = engine.state_dict()["model"]
    engine.close()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=1e-6, rtol=1e-6, msg=name)


def test_load_state_dict_round_trip_with_frozen(cpu_backend):
    model = frozen_model()
    cfg = AdamW(lr=3e-3)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=PLANS["prefetch"](4), backend=cpu_backend, loss_fn=lm_loss)
    data = batches(2)
    engine.train_step(*data[0])
    saved = engine.state_dict()
    loss_a = engine.train_step(*data[1]).item()
    engine.load_state_dict(saved)
    loss_b = engine.train_step(*data[1]).item()
    engine.close()
    assert loss_a == pytest.approx(loss_b, abs=1e-6)


def test_host_bytes_of_frozen_fp32_units_are_4_per_param():
    model = frozen_model()
    units = split_units(model)
    frozen_unit = units[1]
    assert not frozen_unit.trainable and frozen_unit.numel > 0
    assert host_bytes_needed([frozen_unit], set()) == 4 * frozen_unit.numel
    partial = units[2]
    frozen_numel = partial.numel - partial.train_numel
    # trainable fp32: work (= master) + gradient + two moments = 16 B; frozen: 4 B
    assert host_bytes_needed([partial], set()) == 16 * partial.train_numel + 4 * frozen_numel
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    unit = split_units(bf16)[1]
    assert host_bytes_needed([unit], set()) == 2 * unit.numel


def test_unit_layout_is_decay_no_decay_frozen():
    model = frozen_model()
    unit = split_units(model, no_decay=no_decay_names(model))[2]
    kinds = [("frozen" if not p.requires_grad else "plain" if n in no_decay_names(model) else "decay")
             for n, p in unit.params]
    assert kinds == sorted(kinds, key=["decay", "plain", "frozen"].index)
    assert unit.n_trainable == sum(k != "frozen" for k in kinds) and unit.n_decay == kinds.count("decay")


class RMSNormish(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))


class MyRMSNorm(RMSNormish):
    pass


def test_no_decay_names_follow_hf_trainer():
    model = nn.ModuleDict({"ln": nn.LayerNorm(4), "fc": nn.Linear(4, 4), "rms": MyRMSNorm(4), "other": RMSNormish(4),
                           "final_norm": RMSNormish(4)})
    assert no_decay_names(model) == {"ln.weight", "ln.bias", "fc.bias", "rms.scale", "final_norm.scale"}
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_pt_utils import get_parameter_names

    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    model = TinyGPT()
    hf_decay = set(get_parameter_names(model, [nn.LayerNorm], patterns))
    assert {n for n, _ in model.named_parameters()} - hf_decay == no_decay_names(model)
    del transformers


@pytest.mark.parametrize("plan_name", ["prefetch", "device"])
@pytest.mark.parametrize("groups", ["default", "none"])
def test_weight_decay_groups_equal_two_group_adamw(cpu_backend, plan_name, groups):
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = AdamW(lr=3e-3, weight_decay=0.3)
    data = batches(3)
    no_decay = None if groups == "default" else set()
    ref = reference(model, data, cfg, lambda m: param_groups(m, cfg.weight_decay, no_decay))
    state = run(model, data, cfg, PLANS[plan_name](4), cpu_backend, no_decay=no_decay)
    for name, p in ref.items():
        torch.testing.assert_close(state["model"][name], p, atol=1e-6, rtol=1e-6, msg=name)


def test_frozen_with_bf16_compute_dtype(cpu_backend):
    model = frozen_model()
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3), plan=PLANS["prefetch"](4), backend=cpu_backend,
                      loss_fn=lm_loss, compute_dtype=torch.bfloat16)
    frozen_unit = engine.shadow.shadows[1]
    assert frozen_unit.work.dtype == torch.bfloat16 and frozen_unit.master.numel() == 0
    for x, y in batches(2):
        assert torch.isfinite(engine.train_step(x, y)).item()
    state = engine.state_dict()
    engine.close()
    w = dict(model.named_parameters())["blocks.1.qkv.weight"].detach()
    assert state["model"]["blocks.1.qkv.weight"].dtype == torch.float32  # given back in the model's dtype
    assert torch.equal(state["model"]["blocks.1.qkv.weight"], w.to(torch.bfloat16).float())  # frozen: never updated
    assert "blocks.1.qkv.weight" not in state["optimizer"]
