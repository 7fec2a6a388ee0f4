"""peft LoRA linears on the fused path (``strategies.models.lora_fused``): the same outputs and
gradients as peft's own forward, peft's own forward wherever the fused one would not be exact,
and nothing about the model's weights or state dict changed."""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.models import HFCausalLM, fuse_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama(dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    # init_lora_weights=False: lora_B non-zero, so the adapters change outputs and every gradient
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS,
                                                      init_lora_weights=False)).to(dtype)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


def loss_and_grads(model: torch.nn.Module, seed: int = 5) -> tuple[float, dict[str, torch.Tensor]]:
    x, y = batch()
    torch.manual_seed(seed)  # the same dropout masks for both models
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fused_matches_peft_in_fp32():
    ref_model = lora_llama()
    fused_model = copy.deepcopy(ref_model)
    assert fuse_lora(fused_model) == 2 * len(TARGETS)
    ref_loss, ref = loss_and_grads(ref_model)
    loss, grads = loss_and_grads(fused_model)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(grads) == set(ref) and len(ref) == 4 * len(TARGETS)  # lora_A and lora_B per target and layer
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_matches_peft_with_dropout():
    ref_model = lora_llama(dropout=0.3)
    fused_model = copy.deepcopy(ref_model)
    fuse_lora(fused_model)
    ref_model.train(), fused_model.train()
    ref_loss, ref = loss_and_grads(ref_model)
    loss, grads = loss_and_grads(fused_model)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_matches_peft_in_bf16_within_rounding():
    ref_model = lora_llama(dtype=torch.bfloat16)
    fused_model = copy.deepcopy(ref_model)
    fuse_lora(fused_model)
    ref_loss, ref = loss_and_grads(ref_model)
    loss, grads = loss_and_grads(fused_model)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for name, g in ref.items():
        # bf16 keeps 8 bits: the fused sum rounds once where peft rounds three times
        assert (grads[name].float() - g.float()).norm() <= 0.05 * g.float().norm() + 1e-3, name


def test_input_gradient_flows_through_the_adapter():
    layer = lora_llama().base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, 32, requires_grad=True)
    ref = layer(x)
    ref.square().sum().backward()
    ref_dx = x.grad.clone()
    x.grad = None
    fuse_lora(layer)
    out = layer(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_dx)


def test_peft_paths_the_fused_forward_leaves_to_peft():
    model = lora_llama()
    x, _ = batch()
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(input_ids=x).logits
        fuse_lora(model)
        with model.disable_adapter():  # adapters off: the base model's logits
            torch.testing.assert_close(model(input_ids=x).logits, plain)
        adapted = model(input_ids=x).logits
        model.merge_adapter()  # merged: the base layer alone, already holding the adapter
        torch.testing.assert_close(model(input_ids=x).logits, adapted, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
    assert not torch.allclose(adapted, plain)  # the adapters do change the outputs


def test_fusing_keeps_weights_and_names_and_is_idempotent():
    model = lora_llama()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    assert fuse_lora(model) == fuse_lora(model) == 2 * len(TARGETS)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    assert fuse_lora(torch.nn.Linear(4, 4)) == 0  # nothing of peft: left alone


def test_hf_causal_lm_with_lora_takes_the_fused_path(tmp_path):
    lora_llama().get_base_model().save_pretrained(tmp_path)
    lm = HFCausalLM(path=str(tmp_path), lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    fused = [m for m in lm.modules() if getattr(m, "_xpu_fused_lora", False)]
    assert len(fused) == 4  # two targets in each of two layers


def test_fused_layer_under_selective_checkpointing_matches_peft():
    """Selective checkpointing caches matmul outputs: the fused path must not change one (an
    in-place sum into the base output did, and checkpointing refused it)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    ref = lora_llama().base_model.model.model.layers[0].mlp
    fused = copy.deepcopy(ref)
    fuse_lora(fused)
    x = torch.randn(2, 8, 32)
    grads = []
    for mlp in (ref, fused):
        out = checkpoint(mlp, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
        out.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_deep_copy_of_a_fused_model_runs_on_its_own_weights():
    model = lora_llama()
    fuse_lora(model)
    twin = copy.deepcopy(model)
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=x).logits, model(input_ids=x).logits)
        layer = twin.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.forward.args[0] is layer  # the copy's forward is bound to the copy
        layer.lora_B["default"].weight.add_(1.0)
        assert not torch.allclose(twin(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.gpu
def test_fused_matches_peft_on_the_accelerator_in_bf16(gpu_backend):
    """The device's GEMMs (cuBLAS's beta = 1 path) against peft's three passes, bf16."""
    dev = gpu_backend.device(0)
    ref_model = lora_llama(dtype=torch.bfloat16).to(dev)
    fused_model = copy.deepcopy(ref_model)
    assert fuse_lora(fused_model) == 2 * len(TARGETS)
    x, y = (t.to(dev) for t in batch())
    losses, grads = [], []
    for model in (ref_model, fused_model):
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad})
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 0.05 * g.norm() + 1e-3, name


def test_memferry_fuses_a_peft_model_it_is_given(cpu_backend):
    from strategies.memferry import AdamW, MemFerry

    engine = MemFerry(lora_llama(), optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend)
    try:
        assert sum(getattr(m, "_xpu_fused_lora", False) for m in engine.model.modules()) == 2 * len(TARGETS)
    finally:
        engine.close()


def test_a_model_without_peft_layers_does_not_import_peft():
    """Every engine calls fuse_lora; importing peft there cost each plain run's process 4.6 s (the
    suite's subprocesses paid it about a hundred times)."""
    import subprocess
    import sys

    code = ("import sys, torch; from strategies.models import fuse_lora; "
            "assert fuse_lora(torch.nn.Linear(2, 2)) == 0; print('peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__import__("pathlib").Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", out.stdout
