"""A micro-batch longer than the plan's sample (``batch_growth.py``): planned for before it runs at a
step's start; met later in a step, run again after the out-of-memory re-plan, which plans for it.
Either way no step is lost and training equals torch's AdamW; and the cap ``device_budget`` set holds."""
from __future__ import annotations

import copy
import dataclasses
import gc
import logging

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, UnitPlan
from strategies.memferry.batch_growth import scaled_profile
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.planning import plan_for
from strategies.memferry.rehearsal import ATTEMPTS
from strategies.memferry.scheduler import min_budget
from strategies.memferry.sequence_scaling import batch_shape
from strategies.training.engines import MemFerryEngine
from strategies.weight_decay import param_groups

VOCAB, SHORT, LONG = 96, 8, 32


def model():
    pytest.importorskip("transformers")
    from strategies.models.hf import HFCausalLM

    torch.manual_seed(0)
    m = HFCausalLM({"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}, seq=64)
    m.loss_chunks = 2
    return m


def batch(seq, seed):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, VOCAB, (2, seq + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


@pytest.fixture(scope="module")
def budget():
    """1.2x the least budget of a LONG micro-batch: a plan for it fits, and one keeping every
    block's activations (:func:`keeping`) holds a SHORT micro-batch but not a LONG one."""
    import xpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPU_BACKEND", "cpu")
        xpu.reset_backend()
        backend = xpu.get_backend()
        links = links_from_probe(backend, 0)
        profile = plan_for(model(), batch(SHORT, 1), None, backend=backend, memory_margin=0.0).profile
        b = int(1.2 * min_budget(scaled_profile(profile, 2, LONG), links, margin=0.0))
        keep = keeping(backend, b, 1)
        assert keep.predicted_peak_bytes <= b < predict(keep, scaled_profile(keep.profile, 2, LONG), links, 0.0).peak_bytes
        xpu.reset_backend()
    return b


_KEEPING: dict[tuple, object] = {}


def keeping(backend, budget, accumulation, make=model, sample=None):
    """A plan as the scheduler leaves one (its profile kept, so it can be made again) that prefetches
    every block and keeps its activations: the plan a roomy budget picks for ``sample`` (default
    SHORT rows) of ``make()``'s model, fixed so that the timings' pick cannot decide what a test sees.
    Those of ``model()`` on SHORT rows are made once per budget and accumulation (profiling is
    slow; the plan is fixed); each caller gets its own copy."""
    if make is not model or sample is not None:
        return _keeping(backend, budget, accumulation, make, sample)
    key = (budget, accumulation)
    if key not in _KEEPING:
        _KEEPING[key] = _keeping(backend, budget, accumulation, make, sample)
    return copy.deepcopy(_KEEPING[key])


def _keeping(backend, budget, accumulation, make, sample):
    scheduled = plan_for(make(), sample or batch(SHORT, 1), budget, backend=backend, memory_margin=0.0,
                         accumulation_steps=accumulation)
    keep = dataclasses.replace(scheduled, units=[UnitPlan("prefetch", "prefetch")] * len(scheduled.units),
                               rest_optimizer="host")
    peak = predict(keep, keep.profile, links_from_probe(backend, 0), 0.0).peak_bytes
    return dataclasses.replace(keep, predicted_peak_bytes=peak)


def reference(steps, cfg):
    m = model()
    opt = torch.optim.AdamW(param_groups(m, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    for micro in steps:
        opt.zero_grad()
        for x, y in micro:
            (m(x, y) / len(micro)).backward()
        opt.step()
    return {n: p.detach() for n, p in m.named_parameters()}


def train(backend, budget, steps, cfg):
    """Train ``steps`` through ``xpu train``'s runner; the peak is the device's over the steps after
    those measured with the cap lifted (the first at the longest shape, and a re-plan's after a
    miss, may pass the budget: ``settle_watch``), None if none came after them."""
    x, y = steps[0][0]
    engine = MemFerry(model(), optim=cfg, plan=keeping(backend, budget, len(steps[0])), sample=(x, y),
                      device_budget=budget, backend=backend, memory_margin=0.0, accumulation_steps=len(steps[0]))
    runner = MemFerryEngine(engine)
    longest = max(range(len(steps)), key=lambda i: max(b[0].shape[1] for b in steps[i]))  # the first such step
    measuring = False
    for i, micro in enumerate(steps):
        runner.train_batch(micro)
        if not measuring and i >= longest and "watch" not in engine._setup:
            backend.reset_peak_memory(0)
            measuring = i < len(steps) - 1
    peak = backend.memory_stats(0).peak_allocated if measuring else None
    state, notes, replans = engine.state_dict()["model"], list(engine.plan.notes), runner.replans
    engine.close()
    return state, notes, replans, peak


def test_rows_and_sequence_of_a_forward():
    assert batch_shape((torch.zeros(2, 16, dtype=torch.long),), {}) == (2, 16)
    assert batch_shape((), {"input_ids": torch.zeros(3, 5, dtype=torch.long)}) == (3, 5)
    assert batch_shape((), {"inputs_embeds": torch.zeros(2, 16, 8)}) == (2, 16)
    assert batch_shape((torch.zeros(7, dtype=torch.long),), {}) == (1, 7)
    assert batch_shape(("text",), {}) == (0, 0)


def test_a_profile_scaled_to_more_rows_grows_what_tokens_grow(cpu_backend):
    p = plan_for(model(), batch(SHORT, 1), None, backend=cpu_backend).profile
    assert (p.tokens, p.seq) == (2 * SHORT, SHORT)
    q = scaled_profile(p, 8, SHORT)
    assert q.tokens == 4 * p.tokens and q.input_bytes == 4 * p.input_bytes
    assert q.loss_peak_bytes == 4 * p.loss_peak_bytes and q.rest_fwd_s == pytest.approx(4 * p.rest_fwd_s)
    for a, b in zip(p.blocks, q.blocks):
        assert (b.act_bytes, b.act_bytes_recompute) == (4 * a.act_bytes, 4 * a.act_bytes_recompute)
        assert b.fwd_s == pytest.approx(4 * a.fwd_s) and (b.numel, b.param_bytes) == (a.numel, a.param_bytes)
    assert (q.rest_numel, q.host_adamw_s_per_param) == (p.rest_numel, p.host_adamw_s_per_param)
    assert scaled_profile(p, 2, SHORT) is p


def test_the_part_of_the_activations_growing_with_the_sequence_s_square_is_measured_and_scaled(cpu_backend):
    """A block keeping its attention scores (eager attention) saves rows x heads x seq² more: the
    profile's half-length reading tells that part, and a profile scaled from 8 to 32 tokens a row
    predicts what one measured at 32 saves, where scaling by tokens alone under-counts it."""
    def eager():
        m = model()
        m.base.config._attn_implementation = "eager"
        return m

    short = plan_for(eager(), batch(SHORT, 1), None, backend=cpu_backend).profile
    long = plan_for(eager(), batch(LONG, 1), None, backend=cpu_backend).profile
    gc.collect()
    assert cpu_backend.memory_stats(0).allocated == 0  # the half-length pass leaves nothing on the device
    scaled = scaled_profile(short, 2, LONG)
    for s, q, m in zip(short.blocks, scaled.blocks, long.blocks):
        assert 0 < s.act_bytes_half_seq < s.act_bytes / 2  # the square part halves twice
        assert s.act_bytes * LONG / SHORT < m.act_bytes  # by tokens alone: too few
        assert q.act_bytes == pytest.approx(m.act_bytes, rel=0.02)


def test_a_longer_batch_at_a_step_s_start_is_planned_for_before_it_runs(cpu_backend, budget, caplog):
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    steps = [[batch(SHORT, 1)], [batch(LONG, 2)], [batch(LONG, 3)], [batch(SHORT, 4)], [batch(LONG, 5)]]
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        state, notes, replans, peak = train(cpu_backend, budget, steps, cfg)
    planned = [r.getMessage() for r in caplog.records if "planned again for them" in r.getMessage()]
    assert len(planned) == 1 and f"micro-batches of 2 x {LONG} tokens, beyond the 2 x {SHORT}" in planned[0], notes
    assert replans == 0 and peak is not None and peak <= budget  # no step ran out of memory
    for name, p in reference(steps, cfg).items():
        torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)


def test_a_loop_that_knows_its_step_s_micro_batches_fits_the_longest_first(cpu_backend, budget, caplog):
    """``xpu train``'s loop (``MemFerryEngine.train_batch``) calls ``fit_shape`` with the step's
    longest micro-batch: planned for before the step's short first one runs, nothing runs out."""
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    steps = [[batch(SHORT, 1), batch(SHORT, 2)], [batch(SHORT, 3), batch(LONG, 4)], [batch(LONG, 5), batch(SHORT, 6)],
             [batch(LONG, 7), batch(LONG, 8)]]
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        state, notes, replans, peak = train(cpu_backend, budget, steps, cfg)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"micro-batches of 2 x {LONG} tokens" in m and "planned again for them" in m for m in said), said
    assert replans == 0 and peak is not None and peak <= budget
    for name, p in reference(steps, cfg).items():
        torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)


def test_a_longer_batch_later_in_a_step_is_planned_for_when_the_step_runs_again(cpu_backend, budget, caplog):
    """A loop of its own, not fitting first: the longer second micro-batch is warned about and runs
    out of memory; ``replan_after_oom`` plans for it, and the step run again equals torch AdamW's."""
    from strategies.memferry.oom_recovery import replan_after_oom

    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    steps = [[batch(SHORT, 1), batch(SHORT, 2)], [batch(SHORT, 3), batch(LONG, 4)], [batch(LONG, 5), batch(SHORT, 6)]]
    engine = MemFerry(model(), optim=cfg, plan=keeping(cpu_backend, budget, 2), sample=steps[0][0],
                      device_budget=budget, backend=cpu_backend, memory_margin=0.0, accumulation_steps=2)
    failed = 0
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        for micro in steps:
            while True:
                try:
                    for x, y in micro:
                        engine.backward(engine(x, y) / 2)
                    engine.step()
                    break
                except torch.OutOfMemoryError as exc:
                    error = str(exc)
                failed += 1
                note = replan_after_oom(engine, error)
                assert failed == 1 and engine.plan.profile.tokens == 2 * LONG, note
    assert failed == 1 and any("after the step's first micro-batch" in r.getMessage() for r in caplog.records)
    state = engine.state_dict()["model"]
    engine.close()
    for name, p in reference(steps, cfg).items():
        torch.testing.assert_close(state[name], p, atol=1e-5, rtol=1e-5, msg=name)


def test_a_longer_batch_no_plan_holds_is_refused_before_it_runs(cpu_backend, budget):
    x, y = batch(SHORT, 1)
    engine = MemFerry(model(), optim=AdamW(lr=3e-3), plan=keeping(cpu_backend, budget, 1), sample=(x, y),
                      device_budget=budget, backend=cpu_backend, memory_margin=0.0)
    before = copy.deepcopy(engine.state_dict())
    with pytest.raises(ValueError, match=r"micro-batches of 2 x 512 tokens, beyond the 2 x 8 .*, and no plan fits them"):
        engine(*batch(512, 7))
    after = engine.state_dict()
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    engine.train_step(x, y)  # the engine still trains on what fits
    engine.close()


def test_the_first_step_at_a_new_shape_is_measured_and_a_miss_planned_again(cpu_backend, budget, monkeypatch,
                                                                            caplog):
    """The memory model made to miss at the new shape (the profile scaled there counts a quarter
    of the activations and of backward's transients), under a budget below what keeping them
    takes: the plan made for the new shape keeps activations it cannot hold, so its first step,
    run with the cap lifted as the rehearsal's is, peaks over the budget; the plan is made again
    with a margin covering the miss (its own first step watched in turn), and later steps stay
    under the budget, capped again."""
    import strategies.memferry.batch_growth as growth

    real = growth.scaled_profile

    def undercounting(profile, rows, seq):
        p = real(profile, rows, seq)
        if p is profile:
            return p
        return dataclasses.replace(p, blocks=[dataclasses.replace(b, act_bytes=b.act_bytes // 4,
                                                                  act_bytes_half_seq=b.act_bytes_half_seq // 4,
                                                                  bwd_extra_bytes=b.bwd_extra_bytes // 4)
                                              for b in p.blocks])

    keep = keeping(cpu_backend, 2 * budget, 1)
    # under what keeping every activation takes at LONG (the model's figure over-counts that peak
    # by ~13 % here), above the fixture's budget, which a plan for LONG fits
    roomy = min(2 * budget, int(0.8 * predict(keep, real(keep.profile, 2, LONG), links_from_probe(cpu_backend, 0),
                                                  0.0).peak_bytes))
    assert roomy > budget
    monkeypatch.setattr(growth, "scaled_profile", undercounting)
    x, y = batch(SHORT, 1)
    engine = MemFerry(model(), optim=AdamW(lr=1e-3), plan=keep, sample=(x, y),
                      device_budget=roomy, backend=cpu_backend, memory_margin=0.0)
    engine.train_step(x, y)
    with caplog.at_level(logging.WARNING, logger="xpu.memferry"):
        for seed in range(2, 3 + ATTEMPTS):  # the first at the new shape, then each re-plan's
            engine.train_step(*batch(LONG, seed))
    said = [r.getMessage() for r in caplog.records]
    assert any(f"a step at 2 x {LONG} tokens peaked at" in m and "planned again with a" in m for m in said), said
    assert not any("still peaked" in m for m in said) and cpu_backend.memory_cap(0) == roomy  # capped again
    cpu_backend.reset_peak_memory(0)
    engine.train_step(*batch(LONG, 9))
    assert cpu_backend.memory_stats(0).peak_allocated <= roomy
    engine.close()


def test_a_model_that_takes_only_its_own_length_is_scaled_by_tokens_alone(cpu_backend):
    """The half-length pass is a refinement: a model refusing other lengths profiles as before."""
    from torch import nn

    from strategies.memferry.sequence_scaling import half_sequence_bytes

    class FixedLength(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks = nn.Embedding(10, 8), nn.ModuleList([nn.Linear(8, 8)])

        def forward(self, x):
            if x.shape[1] != 16:
                raise ValueError("16 tokens a row only")
            return self.blocks[0](self.emb(x)).sum()

    m = FixedLength()
    x = torch.zeros(2, 16, dtype=torch.long)
    assert half_sequence_bytes(m, list(m.blocks), type, x, None, None, cpu_backend, 0) == {}
    assert half_sequence_bytes(m, list(m.blocks), type, x[:, :2], None, None, cpu_backend, 0) == {}  # too short
