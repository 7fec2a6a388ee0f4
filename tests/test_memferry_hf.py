"""Hugging Face models given straight to MemFerry: no KV cache, ``labels=`` losses, PEFT LoRA (frozen base)."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.weight_decay import param_groups

transformers = pytest.importorskip("transformers")


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float()


def data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)) for _ in range(n)]


def reference(model, batches, cfg):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check(model, cpu_backend, plan, **engine_kw):
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    batches = data(3)
    ref_losses, ref = reference(model, batches, cfg)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=cpu_backend, **engine_kw)
    assert engine.model.config.use_cache is False
    losses = [engine.train_step(x, y).item() for x, y in batches]
    state = engine.state_dict()["model"]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for name, p in ref.items():
        torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)


def test_hf_causal_lm_trains_with_labels(cpu_backend):
    check(tiny_llama(), cpu_backend, Plan.uniform(2, UnitPlan("prefetch", "prefetch")))


def test_peft_lora_trains_only_adapters(cpu_backend):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))
    check(model, cpu_backend, Plan.uniform(2, UnitPlan("prefetch", "prefetch")))


def test_hf_model_plan_auto_profiles_without_cache(cpu_backend):
    model = tiny_llama()
    model.config.use_cache = True
    x, y = data(1)[0]
    engine = MemFerry(model, optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), backend=cpu_backend,
                      device_budget="1GB")
    assert model.config.use_cache is False
    loss = engine.train_step(x, y)
    assert torch.isfinite(loss).item()
    engine.close()


def test_blocks_returning_tuples_are_profiled_and_planned(cpu_backend):
    """Falcon's decoder layers return ``(hidden, attn_weights)`` and its model reads ``[0]``: the
    profiler's stand-ins for the blocks return the same structure, so ``plan="auto"`` profiles
    the rest (a bare tensor made ``[0]`` its first row) and the plan trains as torch AdamW."""
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    hidden_dropout=0.0, attention_dropout=0.0)
    model = transformers.FalconForCausalLM(cfg).float()
    seen = []
    handle = model.transformer.h[0].register_forward_hook(lambda m, a, out: seen.append(type(out)))
    model(data(1)[0][0])
    handle.remove()
    assert seen == [tuple]  # what the stand-ins must mimic
    check(model, cpu_backend, "auto", sample=data(1)[0], device_budget="1GB")


def test_plan_for_profiles_a_model_with_its_cache_on_and_leaves_it_on(cpu_backend):
    """``plan_for`` on a model as ``transformers`` builds it (``use_cache=True``): a cache filled by
    one timed block pass carried its graph into the next (backward through a freed graph); the
    profile runs without one and the model's config is left as it came."""
    from strategies.memferry.planning import plan_for

    model = tiny_llama()
    model.config.use_cache = True
    x, y = data(1)[0]
    plan = plan_for(model, (x, y), "1GB", backend=cpu_backend)
    assert len(plan.units) == 2 and model.config.use_cache is True
