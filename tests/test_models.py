"""The shared models (strategies.models): docs/design.md §3 GPT size, FLOP formula, the Llama variant's shapes and GQA."""
from __future__ import annotations

import copy
import importlib.util
import weakref

import pytest
import torch
import torch.nn.functional as F

from strategies.models import (apply_rotary, build_model, embedding_param_count, flops_per_token, llama_ffn, param_count,
                              rotary_tables, validate_dims)

DESIGN = dict(layers=24, hidden=2048, heads=16, vocab=32000, seq=1024)


def test_design_gpt_has_1_34e9_parameters_counted_on_meta():
    n = param_count("gpt", **DESIGN)
    assert round(n / 1e7) == 134  # 1.34e9
    h, L, V = 2048, 24, 32000
    # per block: fused QKV + proj + 4x MLP weights (12 h^2), their biases (9 h), two LayerNorms (4 h)
    assert n == L * (12 * h * h + 13 * h) + 2 * V * h + 2 * h
    assert embedding_param_count("gpt", **DESIGN) == V * h


def test_flops_per_token_formula():
    n = param_count("gpt", **DESIGN) - 32000 * 2048
    assert flops_per_token("gpt", **DESIGN) == 6 * n + 12 * 24 * 1024 * 2048
    assert flops_per_token("gpt", **DESIGN) == pytest.approx(8.25e9, rel=1e-3)


def test_gpt_forward_and_loss_in_fp32():
    torch.manual_seed(0)
    m = build_model("gpt", layers=2, hidden=32, heads=4, vocab=50, seq=8)
    x = torch.randint(0, 50, (3, 8))
    assert m(x).shape == (3, 8, 50)
    loss = m.to(torch.bfloat16)(x, x)
    assert loss.dtype == torch.float32 and loss.ndim == 0


def test_llama_shapes_and_gqa_by_hand():
    torch.manual_seed(0)
    hidden, heads, kv, T = 64, 8, 2, 6
    m = build_model("llama", layers=1, hidden=hidden, heads=heads, kv_heads=kv, vocab=40, seq=T)
    attn = m.blocks[0].attn
    hd = hidden // heads
    assert attn.q.weight.shape == (heads * hd, hidden)
    assert attn.k.weight.shape == (kv * hd, hidden) and attn.v.weight.shape == (kv * hd, hidden)
    assert m.blocks[0].gate.weight.shape == (llama_ffn(hidden), hidden)
    assert not any(name.endswith("bias") for name, _ in m.named_parameters())
    x = torch.randn(2, T, hidden)
    # By hand: each query head h attends with K/V head h // (heads / kv), causally, after rotary.
    q = (x @ attn.q.weight.T).view(2, T, heads, hd).transpose(1, 2)
    k = (x @ attn.k.weight.T).view(2, T, kv, hd).transpose(1, 2)
    v = (x @ attn.v.weight.T).view(2, T, kv, hd).transpose(1, 2)
    cos, sin = rotary_tables(T, hd, 10000.0, x.device)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    mask = torch.ones(T, T).tril().bool()
    outs = []
    for h in range(heads):
        g = h // (heads // kv)
        s = (q[:, h] @ k[:, g].transpose(-1, -2)) / hd ** 0.5
        outs.append(torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, g])
    y = torch.stack(outs, 1).transpose(1, 2).reshape(2, T, hidden) @ attn.o.weight.T
    torch.testing.assert_close(attn(x), y, atol=1e-5, rtol=1e-4)
    idx = torch.randint(0, 40, (2, T))
    assert m(idx).shape == (2, T, 40)


def test_rotary_preserves_norms_and_position_zero():
    cos, sin = rotary_tables(5, 8, 10000.0, torch.device("cpu"))
    x = torch.randn(1, 1, 5, 8)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])


def test_recompute_gives_the_same_gradients():
    torch.manual_seed(0)
    m = build_model("gpt", layers=2, hidden=32, heads=4, vocab=50, seq=8)
    x = torch.randint(0, 50, (2, 8))
    m(x, x).backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.recompute = True
    m(x, x).backward()
    for a, p in zip(g1, m.parameters()):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.parametrize("in_forward", [False, True], ids=["recomputed", "grad-in-forward"])
@pytest.mark.parametrize("family,dims", [("gpt", dict(layers=2, hidden=32, heads=4, vocab=97)),
                                          ("llama", dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=97))])
def test_sliced_loss_equals_the_whole_loss_and_keeps_no_slice_of_logits(family, dims, in_forward):
    torch.manual_seed(0)
    m = build_model(family, **dims)
    m.loss_grad_in_forward = in_forward
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))

    def run() -> tuple[torch.Tensor, list[int]]:
        saved: list[tuple[int, weakref.ref]] = []

        def pack(t):
            saved.append((t.numel(), weakref.ref(t)))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(x, y)
        kept = [n for n, ref in saved if ref() is not None]  # what forward left for backward
        loss.backward()
        return loss, kept

    whole, kept_whole = run()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.loss_chunks = 6  # 48 tokens: slices of 8
    sliced, kept = run()
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
    for a, p in zip(g1, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)
    # the whole loss keeps logits-sized tensors (48 x 97) for backward; sliced, none is kept
    assert 48 * 97 in kept_whole and 48 * 97 not in kept and 8 * 97 not in kept


HF_TIED = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,dims", [
    ("gpt", dict(layers=2, hidden=32, heads=4, vocab=97, bias=True)),
    ("llama", dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=97)),
    pytest.param("hf", dict(config=HF_TIED, seq=16), marks=pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers not installed"))])
def test_slice_gradients_made_in_forward_equal_recomputed_ones_bit_for_bit(family, dims, dtype):
    """Scales 1 and 1/8 (loss / N, N a power of two): the same bits as recomputing the slices
    in backward; 1/3: within a rounding of the logits' gradient (then carried through the
    blocks). Ignored targets and a head tied to the input embedding included."""
    torch.manual_seed(0)
    m = build_model(family, **dims).to(dtype)
    m.loss_chunks = 5  # 48 tokens: slices of 10, the last of 8
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
    y[0, :5] = -100
    for n in (1, 8, 3):
        out = {}
        for in_forward in (False, True):
            mm = copy.deepcopy(m)
            mm.loss_grad_in_forward = in_forward
            loss = mm(x, y)
            (loss / n).backward()
            out[in_forward] = loss.detach(), [p.grad for p in mm.parameters()]
        assert torch.equal(out[True][0], out[False][0])
        for a, b in zip(out[True][1], out[False][1]):
            if n in (1, 8):
                assert torch.equal(a, b)
            else:  # measured: 2.4 % of the largest element in bf16 (through the blocks), 1e-6 in fp32
                bound = 0.05 if dtype == torch.bfloat16 else 1e-5
                assert (a.float() - b.float()).abs().max() <= bound * b.float().abs().max()


def test_slice_gradients_made_in_forward_are_given_out_once():
    m = build_model("gpt", layers=1, hidden=16, heads=2, vocab=31)
    m.loss_chunks = 2
    x = torch.randint(0, 31, (2, 8))
    loss = m(x, x)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="loss_grad_in_forward = False"):
        loss.backward()
    m.loss_grad_in_forward = False  # what the message says works
    loss = m(x, x)
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("family,dims,match", [
    ("bert", {}, "valid families"),
    ("gpt", {"layers": 2, "hidden": 30, "heads": 4, "vocab": 9}, "multiple of heads"),
    ("gpt", {"layers": 2, "hidden": 32, "heads": 4, "vocab": 9, "depth": 3}, "valid"),
    ("llama", {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 3, "vocab": 9}, "kv_heads"),
    ("hf", {"config": {}}, "model_type"),
])
def test_bad_dims_are_named(family, dims, match):
    with pytest.raises(ValueError, match=match):
        validate_dims(family, dims)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hf_causal_lm_from_config():
    cfg = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50}
    m = build_model("hf", config=cfg, seq=8)
    assert len(m.blocks) == 2
    x = torch.randint(0, 50, (2, 8))
    assert m(x, x).ndim == 0
    assert param_count("hf", config=cfg, seq=8) == sum(p.numel() for p in m.parameters())


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("model_type, extra", [("gemma2", {"head_dim": 8, "final_logit_softcapping": 2.0}),
                                               ("cohere", {"logit_scale": 0.5})])
def test_hf_logits_mapped_after_the_head_are_mapped_in_the_sliced_loss(model_type, extra):
    """Gemma 2 soft-caps its logits, Cohere scales them: the loss over slices does as the model's own forward."""
    torch.manual_seed(0)
    m = build_model("hf", config={"model_type": model_type, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 50, **extra}, seq=8).train()
    with torch.no_grad():
        m.head.weight.mul_(50)  # logits of a few units: the cap and the scale change the loss
    x, y = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    own = m(x, y)
    unmapped = F.cross_entropy(m.head(m.features(x)).float().reshape(-1, 50), y.reshape(-1))
    assert not torch.allclose(unmapped, own, rtol=1e-3)
    m.loss_chunks = 4
    torch.testing.assert_close(m(x, y), own, rtol=1e-6, atol=0)
