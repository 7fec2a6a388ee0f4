"""MemFerry on ``transformers`` architectures other than Llama's, each a tiny random model (no
download): planned with ``plan="auto"`` under a budget, its loss over slices (``slice_hf_loss``),
two micro-batches per step and clipping, against torch AdamW on the model as it came.

Each stands for a way a model differs: blocks returning tuples (Falcon, Bloom), Conv1D linears
and learned positions (GPT-2), logits soft-capped or scaled after the head (Gemma 2, Cohere),
mixture-of-experts blocks (Mixtral), fused projections (Phi-3, GPT-NeoX), a decoder with its own
projection sizes (OPT), norms over each head's queries and keys (Qwen3)."""
from __future__ import annotations

import functools

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.weight_decay import param_groups

transformers = pytest.importorskip("transformers")

from strategies.models import slice_hf_loss  # noqa: E402

VOCAB = 128
ARCHS = {
    "falcon": {},
    "bloom": {"n_head": 4},
    "gpt2": {"n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64},
    "gemma2": {"head_dim": 8, "final_logit_softcapping": 2.0},
    "cohere": {"logit_scale": 0.5},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {},
    "gpt_neox": {},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "qwen3": {},
}
_DROPOUTS = ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
             "activation_dropout", "attn_dropout")


def tiny(model_type):
    torch.manual_seed(0)
    dims = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                **{k: 0.0 for k in _DROPOUTS}, **ARCHS[model_type])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **dims))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # logits of a few units: caps and scales change the loss
    return model.float().train()


def steps():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(1, VOCAB, (2, 16), generator=g) for _ in range(2)] for _ in range(2)]


@functools.cache
def reference(model_type, cfg):
    """Torch AdamW's weights after ``steps()`` on ``tiny(model_type)``: made once for the three
    plans' cases of an architecture (the model and data are seeded: each case's would be the same)."""
    ref = tiny(model_type)
    opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    for micro in steps():
        opt.zero_grad()
        for x in micro:
            (ref(input_ids=x, labels=x).loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.max_grad_norm)
        opt.step()
    return {name: p.detach().clone() for name, p in ref.named_parameters()}


@pytest.mark.parametrize("plan", ["auto", "dha", "offload"])
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_an_architecture_trains_as_torch_adamw(cpu_backend, model_type, plan):
    """``auto`` under a budget every plan fits (which plan the timings pick must not decide
    whether it fits); ``dha``: every block's linears read in place from host memory; ``offload``:
    every block's saved activations out to the host and back (fused projections' slices with
    their storage)."""
    model, data = tiny(model_type), steps()
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
    ref = reference(model_type, cfg)
    given = {"plan": "auto", "sample": (data[0][0], data[0][0]), "device_budget": "1GB"} if plan == "auto" else {
        "plan": Plan.uniform(3, UnitPlan("prefetch", "prefetch", offload=True)) if plan == "offload" else plan}
    engine = MemFerry(slice_hf_loss(model, 4), optim=cfg, accumulation_steps=2, backend=cpu_backend, **given)
    if plan == "offload":
        engine.executor.swapper.min_bytes = 0  # tiny tensors: swap them all the same
    for micro in data:
        for x in micro:
            engine.backward(engine(input_ids=x, labels=x).loss / len(micro))
        engine.step()
    state = engine.state_dict()["model"]
    swapped = engine.executor.swapper.stats.as_dict() if plan == "offload" else None
    engine.close()
    if swapped is not None:
        assert swapped["bytes"].get("host", 0) > 0 and swapped["swapped_in"] == swapped["bytes"]["host"], swapped
    for name, p in ref.items():
        torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)
