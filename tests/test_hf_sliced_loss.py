"""``slice_hf_loss``: a Hugging Face causal LM's training loss over token slices, no whole logits
(``strategies/models/hf_sliced_loss.py``), against the model's own loss."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.models.hf_sliced_loss import slice_hf_loss  # noqa: E402

VOCAB = 97


def tiny(model_type="llama", tied=False, **extra):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, tie_word_embeddings=tied, **extra)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # masked prompt tokens
    return ids, labels


def _run(model, **extra):
    """Loss, gradients by name, and the sizes of the tensors forward left for backward."""
    ids, labels = batch()
    kept: list[tuple[int, weakref.ref]] = []

    def pack(t):
        kept.append((t.numel(), weakref.ref(t)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=labels, **extra).loss
    alive = [n for n, ref in kept if ref() is not None]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, alive


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(37)}], ids=["mean", "num_items"])
def test_sliced_loss_equals_the_model_s_own_and_keeps_no_logits(tied, extra):
    model = tiny(tied=tied)
    own_loss, own_grads, own_kept = _run(copy.deepcopy(model), **extra)
    sliced = slice_hf_loss(copy.deepcopy(model), 4)
    loss, grads, kept = _run(sliced, **extra)
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=0)
    assert grads.keys() == own_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, own_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert 48 * VOCAB in own_kept  # the whole logits (fp32 too), kept for backward
    assert 48 * VOCAB not in kept and 12 * VOCAB not in kept  # not even one slice's


@pytest.mark.parametrize("model_type, extra", [
    ("gemma2", {"head_dim": 8, "final_logit_softcapping": 2.0}),  # tanh(z / cap) * cap: a cap that bites
    ("cohere", {"logit_scale": 0.5}),
    ("granite", {"logits_scaling": 4.0}),
])
def test_logits_mapped_after_the_head_are_mapped_on_each_slice(model_type, extra):
    model = tiny(model_type, **extra)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits of a few units, where the cap and the scales change the loss
    own_loss, own_grads, _ = _run(copy.deepcopy(model))
    plain = copy.deepcopy(model)
    key = next(k for k in extra if k != "head_dim")
    setattr(plain.config, key, {"final_logit_softcapping": None}.get(key, 1.0))  # no mapping
    if model_type == "cohere":
        plain.logit_scale = 1.0  # Cohere reads its own copy
    unmapped = _run(plain)[0]
    assert not torch.allclose(unmapped, own_loss, rtol=1e-3)  # the mapping changes the loss
    loss, grads, _ = _run(slice_hf_loss(copy.deepcopy(model), 4))
    torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, own_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_lora_model_slices_through_peft():
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type=peft.TaskType.CAUSAL_LM)
    torch.manual_seed(0)
    own = peft.get_peft_model(tiny(), cfg)
    sliced = slice_hf_loss(copy.deepcopy(own), 3)
    a, b = _run(own), _run(sliced)
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=0)
    assert a[1].keys() == b[1].keys() and all("lora" in n for n in a[1])
    for name, g in b[1].items():
        torch.testing.assert_close(g, a[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_without_labels_or_gradients_the_model_s_own_forward_runs_unless_told():
    model = tiny()
    own = slice_hf_loss(copy.deepcopy(model), 4)
    ids, labels = batch()
    assert own(input_ids=ids).logits.shape == (3, 16, VOCAB)
    own.eval()
    with torch.no_grad():
        whole = own(input_ids=ids, labels=labels)
    assert whole.logits.shape == (3, 16, VOCAB)
    loss_only = slice_hf_loss(copy.deepcopy(model), 4, eval_logits=False).eval()
    with torch.no_grad():
        out = loss_only(input_ids=ids, labels=labels)
    assert "logits" not in out
    torch.testing.assert_close(out.loss, whole.loss, rtol=1e-6, atol=0)


def _scaling_its_logits():
    """A causal LM that halves its logits in its own forward (no config field says so)."""
    class Halved(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out
    return Halved(tiny().config)


@pytest.mark.parametrize("make, chunks, match", [
    (lambda: tiny(), 0, "positive integer"),
    (_scaling_its_logits, 4, "changes its logits after the output embedding in a way not known here"),
    (lambda: tiny("granite", logits_scaling=4.0, final_logit_softcapping=30.0), 4,
     r"sets \['final_logit_softcapping', 'logits_scaling'\] together"),
    (lambda: torch.nn.Linear(2, 2), 4, "not a Hugging Face causal LM"),
])
def test_what_cannot_be_sliced_is_refused_in_one_line(make, chunks, match):
    with pytest.raises(ValueError, match=match) as err:
        slice_hf_loss(make(), chunks)
    assert "\n" not in str(err.value)
