"""The head and loss in MemFerry's memory model: the scheduler's predicted peak against the cpu
backend's measured one, with the loss whole (loss_chunks 1) and in token slices (loss_chunks 8).

The models have a large vocabulary beside a small hidden size (vocab 4096, hidden 32), so the
head's logits dominate the step's memory, as Qwen2-1.5B's do under an 8 GB cap.
"""
from __future__ import annotations

import copy
import gc
import json

import pytest
import torch

from strategies.memferry import AdamW, MemFerry
from strategies.memferry.cost import auto_loss_chunks, links_from_probe, loss_peak_estimate, predict
from strategies.memferry.profiler import StepProfile, profile_step
from strategies.memferry.scheduler import NoPlanFitsError, min_budget, schedule
from strategies.memferry.units import split_units

VOCAB, HIDDEN, BATCH, SEQ = 4096, 32, 2, 64
TOKENS = BATCH * SEQ
#: The predicted peak may exceed the measured by this share (never fall below it): ``rest``'s
#: gradients are counted whole beside a block's backward, though an untied input embedding's
#: gradient arrives only at backward's end (the profile does not split ``rest``).
OVER = 0.15


def hf_model(model_type: str, tied: bool, chunks: int):
    pytest.importorskip("transformers")
    from strategies.models.hf import HFCausalLM

    torch.manual_seed(0)
    m = HFCausalLM({"model_type": model_type, "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "tie_word_embeddings": tied}, seq=SEQ)
    m.loss_chunks = chunks
    return m


def own_model(chunks: int):
    from strategies.models import build_model

    torch.manual_seed(0)
    m = build_model("llama", layers=2, hidden=HIDDEN, heads=4, vocab=VOCAB, seq=SEQ)
    m.loss_chunks = chunks
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def measured_peak(backend, model, plan, budget, x, y) -> int:
    """Peak device bytes of the second step (the first allocates the steady state), over what
    the device held before the engine existed."""
    gc.collect()
    before = backend.memory_stats(0).allocated
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3), plan=plan, backend=backend, blocks=None,
                      device_budget=budget)
    engine.train_step(x, y)
    backend.synchronize(0)
    backend.reset_peak_memory(0)
    engine.train_step(x, y)
    backend.synchronize(0)
    peak = backend.memory_stats(0).peak_allocated - before
    engine.close()
    return peak


MODELS = {
    "qwen2-tied": lambda c: hf_model("qwen2", True, c),
    "llama-hf-untied": lambda c: hf_model("llama", False, c),
    "llama-own": own_model,
}


@pytest.mark.parametrize("name,chunks", [("qwen2-tied", 1), ("qwen2-tied", 8), ("llama-hf-untied", 8),
                                         ("llama-own", 8)])
def test_predicted_peak_bounds_the_measured_one(cpu_backend, name, chunks):
    """At the smallest budget any plan fits and at a roomy one, the chosen plan's predicted peak
    (margin 0) is at least the measured peak and at most ``OVER`` above it; the step runs
    under a cap of exactly the predicted bytes."""
    model = MODELS[name](chunks)
    x, y = batch()
    links = links_from_probe(cpu_backend, 0)
    prof = profile_step(model, split_units(model, model.blocks), cpu_backend, 0, x, y, blocks=model.blocks, repeats=1,
                        adamw_numel=1 << 16)
    assert (prof.vocab, prof.hidden, prof.loss_chunks) == (VOCAB, HIDDEN, chunks)
    for budget in (min_budget(prof, links, margin=0.0), 10**9):
        plan = schedule(prof, links, budget, allow_dha=False, margin=0.0, explain=False)
        pred = predict(plan, prof, links, 0.0).peak_bytes
        got = measured_peak(cpu_backend, model, plan, pred, x, y)
        assert pred * (1 - OVER) <= got <= pred, (budget, plan.describe(), pred, got)


def test_the_loss_peak_follows_loss_chunks_and_the_estimate_bounds_it(cpu_backend):
    """Sliced logits take about an eighth of the whole ones' bytes in the profile and in the
    prediction; the shape-based estimate (used where the profile cannot measure) is an upper
    bound within 50 % of what was measured."""
    x, y = batch()
    links = links_from_probe(cpu_backend, 0)
    peaks = {}
    for chunks in (1, 8):
        model = hf_model("qwen2", True, chunks)
        prof = profile_step(model, split_units(model, model.blocks), cpu_backend, 0, x, y, blocks=model.blocks,
                            repeats=1, adamw_numel=1 << 16)
        est = loss_peak_estimate(TOKENS, VOCAB, HIDDEN, chunks, 4)
        assert prof.loss_peak_bytes <= est <= 1.5 * prof.loss_peak_bytes
        peaks[chunks] = (prof.loss_peak_bytes, min_budget(prof, links, margin=0.0))
    logits = TOKENS * VOCAB * 4
    assert peaks[1][0] >= 2.5 * logits  # fp32 logits, log-softmax and gradient, all at once
    assert peaks[1][0] - peaks[8][0] >= 2 * logits * 7 / 8  # what slicing saves, in profile and plan
    assert peaks[1][1] - peaks[8][1] >= 2 * logits * 7 / 8


def test_a_budget_only_slicing_fits_is_planned_and_trains_and_the_whole_loss_is_refused(cpu_backend):
    """5 MB: whole logits (6.3 MB with log-softmax and gradient) fit no plan and the message
    names the fewest slices that fit and what the smallest plan then needs, at least what a
    profile made with that many slices needs and within 25 % of it; in 8 slices plan='auto' fits and three steps run
    under the cap. Where no slicing fits, the message does not offer it."""
    x, y = batch()
    budget = 5_000_000
    with pytest.raises(NoPlanFitsError, match=r"at loss_chunks (\d+) the smallest plan needs about ([\d.]+ MB) "
                                              r"\(.*slice_hf_loss\(model, chunks\)") as refused:
        MemFerry(hf_model("qwen2", True, 1), optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=budget,
                 backend=cpu_backend)
    import re
    chunks, named = re.search(r"loss_chunks (\d+) the smallest plan needs about ([\d.]+ MB)", str(refused.value)).groups()
    assert 1 < int(chunks) <= 8
    with pytest.raises(NoPlanFitsError) as sliced:  # what a profile made with that many slices needs
        MemFerry(hf_model("qwen2", True, int(chunks)), optim=AdamW(lr=1e-3), plan="auto", sample=(x, y),
                 device_budget=1_000_000, backend=cpu_backend)
    need = int(re.search(r"\((\d+) bytes", str(sliced.value)).group(1))
    assert need <= float(named.split()[0]) * 1e6 + 50_000 <= 1.25 * need + 50_000  # named to 0.1 MB, never short
    with pytest.raises(NoPlanFitsError) as too_small:  # a block alone is over it: no slicing helps
        MemFerry(hf_model("qwen2", True, 1), optim=AdamW(lr=1e-3), plan="auto", sample=(x, y), device_budget=1_000_000,
                 backend=cpu_backend)
    assert "loss_chunks" not in str(too_small.value)
    model = hf_model("qwen2", True, 8)
    engine = MemFerry(model, optim=AdamW(lr=1e-2), plan="auto", sample=(x, y), device_budget=budget,
                      backend=cpu_backend)
    assert "at loss_chunks 8" in engine.plan.notes[0]
    cpu_backend.reset_peak_memory(0)  # the profile ran before the cap
    losses = [float(engine.train_step(x, y)) for _ in range(3)]
    assert cpu_backend.memory_stats(0).peak_allocated <= budget
    engine.close()
    assert losses[-1] < losses[0]


def test_auto_loss_chunks_keeps_a_slice_within_its_share():
    """Qwen2-1.5B at 4 x 2048 tokens under 8 GB: 20 slices of at most 250 MB of fp32 logits;
    a small vocabulary keeps the loss whole."""
    assert auto_loss_chunks(8192, 151936, 8e9) == 20
    assert 8192 / 20 * 151936 * 4 <= 8e9 / 32 < 8192 / 19 * 151936 * 4
    assert auto_loss_chunks(256, 128, 2e9) == 1
    assert auto_loss_chunks(4, 10**9, 1e6) == 4  # never more slices than tokens


def test_profiles_written_before_the_head_fields_still_load():
    """The new fields have defaults: an older profile's JSON loads, with the loss taken as whole."""
    data = {"blocks": [{"numel": 1, "param_bytes": 4, "fwd_s": 1e-3, "bwd_s": 2e-3, "act_bytes": 8,
                        "act_bytes_recompute": 4}], "rest_numel": 1, "rest_param_bytes": 4, "rest_fwd_s": 1e-3,
            "rest_bwd_s": 1e-3, "loss_peak_bytes": 16, "input_bytes": 8, "dtype_bytes": 4, "tokens": 2,
            "host_adamw_s_per_param": 1e-9, "device_adamw_s_per_param": 1e-10}
    prof = StepProfile.from_json(json.dumps(data))
    assert (prof.loss_chunks, prof.vocab, prof.blocks[0].act_bytes_offload_kept) == (1, 0, 0)


def test_train_loss_chunks_auto_slices_large_logits_only(cpu_backend):
    """``strategy.options.loss_chunks: auto`` (the default) slices when one batch's fp32
    logits exceed 1/32 of the budget, keeps a given count, and leaves a model that cannot
    slice its loss whole."""
    from types import SimpleNamespace

    from strategies.training.engines import _loss_chunks

    model = own_model(1)
    cfg = SimpleNamespace(batch=BATCH, seq=SEQ, device_budget=16_000_000)  # 2.1 MB of logits, 0.5 MB a slice
    assert _loss_chunks("auto", model, cfg, cpu_backend, 0) == 5
    assert _loss_chunks("auto", model, SimpleNamespace(batch=BATCH, seq=SEQ, device_budget=None), cpu_backend, 0) == 1
    assert _loss_chunks(3, model, cfg, cpu_backend, 0) == 3
    assert _loss_chunks("auto", torch.nn.Linear(2, 2), cfg, cpu_backend, 0) == 1
