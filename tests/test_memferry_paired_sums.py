"""Micro-batches summed two at a time on the host (``accumulation.paired_units``): a paired unit's
gradients land in two zones in turn and one pass adds both to the fp32 sum, in the order two
passes would. Bit-equal to summing them one by one, for even and odd micro-batch counts and for
a step cut short; the pass, the eligibility and the host bytes checked on their own. Without
clipping a step's last pair is added by the update as it reads it (``UnitShadow.last_pair``),
and an odd count's last micro-batch as it reads the sum (``last_alone``), bit-equal to summing
them first."""
from __future__ import annotations

import copy

import pytest
import torch

import strategies.memferry.engine as engine_module
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.accumulation import paired_units
from strategies.memferry.host_kernel import SinglePassKernel, TorchKernel
from strategies.memferry.host_loops import host_loops
from strategies.memferry.shadow import UnitShadow
from strategies.memferry.shadow_sizing import host_bytes_needed
from strategies.memferry.units import split_units
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss


@pytest.mark.parametrize("kernel", [lambda: SinglePassKernel(AdamW(), [], threads=2), lambda: TorchKernel(AdamW(), [])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("init", [True, False])
def test_a_pair_in_one_pass_equals_two_passes(kernel, dtype, init):
    k = kernel()
    torch.manual_seed(0)
    n = 2**16 + 5  # several threads' parts and a tail
    # magnitudes far apart, so adding g0 + g1 first would round differently from (acc + g0) + g1
    g0, g1 = (torch.randn(n) * 10).to(dtype), (torch.randn(n) * 1e-3).to(dtype)
    start = torch.randn(n) * 100
    paired, one_by_one = start.clone(), start.clone()
    k.accumulate_pair(paired, g0, g1, init)
    if init:
        one_by_one.copy_(g0)
    else:
        k.accumulate(one_by_one, g0)
    k.accumulate(one_by_one, g1)
    assert torch.equal(paired, one_by_one)


PLAN = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device"),
             UnitPlan("resident", "resident"), UnitPlan("prefetch", "prefetch", accumulate="device")])



@pytest.mark.parametrize("kind", ["single-pass", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("work", [torch.bfloat16, None])
@pytest.mark.parametrize("earlier", [True, False])
def test_an_update_from_the_last_pair_equals_summing_it_first(kind, dtype, work, earlier):
    """``(acc + g0) + g1`` (``earlier``: micro-batches summed before the pair) or ``g0 + g1`` read
    in the update's sweep: master, moments and working copy bit-equal to summing into ``grad_acc``
    and updating from it (both kernels); ``grad_acc`` itself is only read."""
    if kind == "single-pass" and dtype not in host_loops().dtypes:
        pytest.skip(f"{dtype} not built here")
    torch.manual_seed(1)
    n = 2**16 + 5
    g0, g1 = (torch.randn(n) * 10).to(dtype), (torch.randn(n) * 1e-3).to(dtype)
    acc0 = torch.randn(n) * 100

    def shadow() -> UnitShadow:
        master = torch.linspace(-2, 2, n)
        s = UnitShadow(None, master if work is None else master.to(work), master, torch.zeros(n), torch.zeros(n),
                       g0.clone(), g0.clone(), None, [])
        s.grad_stage2, s.grad_acc, s.accumulated = g1.clone(), acc0.clone(), earlier
        return s

    fused, summed = shadow(), shadow()
    cfg = AdamW(weight_decay=0.1)
    k = (SinglePassKernel(cfg, [fused, summed], threads=2) if kind == "single-pass"
         else TorchKernel(cfg, [fused, summed], chunk=1000))
    fused.last_pair = True
    k.apply(fused, 1.0)
    k.accumulate_pair(summed.grad_acc, summed.grad_stage, summed.grad_stage2, init=not earlier)
    summed.accumulated = True
    k.apply(summed, 1.0)
    for name in ("master", "exp_avg", "exp_avg_sq", "work"):
        assert torch.equal(getattr(fused, name), getattr(summed, name)), name
    assert torch.equal(fused.grad_acc, acc0)  # read, never written


@pytest.mark.parametrize("kind", ["single-pass", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("first", [False, True])
def test_an_update_from_the_sum_and_one_more_equals_summing_it_first(kind, dtype, first):
    """``acc + g`` read in the update's sweep (the C loop's form 8, and 9 copying first): master,
    moments, working copy (and the fp32 gradient a first pass writes) bit-equal to summing ``g``
    into ``grad_acc`` and updating from that; ``grad_acc`` itself is only read."""
    if kind == "single-pass" and dtype not in host_loops().dtypes:
        pytest.skip(f"{dtype} not built here")
    if first and kind == "torch":
        pytest.skip("the torch kernel does not split")
    torch.manual_seed(2)
    n = 2**16 + 5
    g, acc0 = (torch.randn(n) * 1e-3).to(dtype), torch.randn(n) * 100

    def shadow() -> UnitShadow:
        master = torch.linspace(-2, 2, n)
        s = UnitShadow(None, master.to(torch.bfloat16), master, torch.zeros(n), torch.zeros(n), g.clone(), g.clone(),
                       None, [])
        s.grad_acc, s.accumulated = acc0.clone(), True
        return s

    one_more, summed = shadow(), shadow()
    cfg = AdamW(weight_decay=0.1)
    k = (SinglePassKernel(cfg, [one_more, summed], threads=2) if kind == "single-pass"
         else TorchKernel(cfg, [one_more, summed], chunk=1000))
    one_more.last_alone = 0
    assert len(one_more.grad_terms) == 2 and one_more.grad_terms[0] is one_more.grad_acc
    k.accumulate(summed.grad_acc, summed.grad_stage)
    if first:  # a split update's first pass: the working copy and the fp32 gradient, no state
        outs = [torch.full((n,), float("nan")) for _ in range(2)]
        for s, out in zip((one_more, summed), outs):
            for _ in k.split(s, out, whole=True)[0]:
                pass
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], summed.grad_acc)
    else:
        k.apply(one_more, 1.0)
        k.apply(summed, 1.0)
    for name in ("master", "exp_avg", "exp_avg_sq", "work"):
        assert torch.equal(getattr(one_more, name), getattr(summed, name)), name
    assert torch.equal(one_more.grad_acc, acc0)  # read, never written


def _train(cpu_backend, monkeypatch, paired: bool, micro: list[int], n: int, clip: float | None) -> dict:
    """Steps of ``micro[i]`` micro-batches each (fewer than ``n``: the step is cut short), bf16 compute."""
    if not paired:
        monkeypatch.setattr(engine_module, "paired_units", lambda *a, **k: frozenset())
    torch.manual_seed(0)
    model = TinyGPT()
    data = iter(batches(sum(micro), seed=2))
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=clip), plan=PLAN,
                      backend=cpu_backend, loss_fn=lm_loss, accumulation_steps=n, compute_dtype=torch.bfloat16)
    zones = [s.unit.index for s in engine.shadow.shadows if s.grad_stage2 is not None]
    # paired: the host-updated blocks summing on the host (0, 2) and the rest unit; not the
    # device-updated block 1 nor block 3, which sums on the device
    assert zones == ([0, 2, 4] if paired else [])
    pairs, fused = [], []
    kernel = engine.optimizer.kernel
    real, real_pieces = kernel.accumulate_pair, kernel.pieces
    kernel.accumulate_pair = lambda *a, **k: (pairs.append(1), real(*a, **k))
    kernel.pieces = lambda sh, *a, **k: (
        fused.append("alone" if sh.last_alone is not None else "pair" if sh.last_pair else None),
        real_pieces(sh, *a, **k))[1]
    for count in micro:
        for _ in range(count):
            x, y = next(data)
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / n)
        engine.step()
    state = engine.state_dict()
    engine.close()
    # every two micro-batches of a step made one pass per paired unit; without clipping a whole
    # step's last pair is left to the update, which adds it (and the sum before it) as it reads,
    # and of an odd count its last micro-batch, added to the sum
    full = [clip is None and c == n for c in micro]
    assert len(pairs) == len(zones) * sum((c - 1) // 2 if f else c // 2 for c, f in zip(micro, full))
    kinds = [("alone" if c % 2 and c > 2 else "pair") for c, f in zip(micro, full) if f for _ in zones]
    assert [k for k in fused if k] == kinds
    monkeypatch.undo()
    return state


@pytest.mark.parametrize("n,micro", [(4, [4, 4]), (3, [3, 3]), (4, [3, 1, 4]), (2, [2, 2, 2])])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_paired_sums_train_bit_equal_to_one_by_one(cpu_backend, monkeypatch, n, micro, clip):
    """Even and odd counts, steps cut short after 3 and after 1 micro-batch (the first zone's
    gradient waits for a pair that never comes), with and without (speculative) clipping."""
    a = _train(cpu_backend, monkeypatch, True, micro, n, clip)
    b = _train(cpu_backend, monkeypatch, False, micro, n, clip)
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for name, st in a["optimizer"].items():
        assert all(torch.equal(st[key], b["optimizer"][name][key]) for key in ("master", "exp_avg", "exp_avg_sq")), name


def test_which_units_are_paired_and_what_their_zone_costs():
    units = split_units(TinyGPT())
    plan = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha"),
                 UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch", accumulate="device")],
                rest_optimizer="device")
    # only block 0: block 1 is DHA, block 2 device-updated, block 3 sums on the device, rest device-updated
    assert paired_units(units, plan, 4, data_parallel=False) == {0}
    assert paired_units(units, plan, 1, data_parallel=False) == frozenset()
    assert paired_units(units, plan, 4, data_parallel=True) == frozenset()
    homes = {2, 4}
    extra = host_bytes_needed(units, homes, accumulate=True, paired=frozenset({0})) - host_bytes_needed(
        units, homes, accumulate=True)
    assert extra == units[0].train_numel * 4  # a second fp32 landing zone (the model is fp32)


def test_an_update_from_a_pair_refuses_what_it_cannot_sum():
    loops = host_loops()
    n = 1000
    p, m, v, acc = (torch.zeros(n) for _ in range(4))
    g = torch.zeros(n, dtype=torch.bfloat16)
    kw = dict(grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.99, bias_correction2_sqrt=1.0, eps=1e-8, step_size=1e-3,
              threads=1)
    with pytest.raises(ValueError, match=r"grad must be a tensor, \(g0, g1\), \(acc, g\) or \(acc, g0, g1\); got 4 tensors"):
        loops.adamw(p, (acc, g, g, g), m, v, None, **kw)
    with pytest.raises(ValueError, match="must share a dtype, got torch.bfloat16 and torch.float32"):
        loops.adamw(p, (g, acc), m, v, None, **kw)
    with pytest.raises(ValueError, match="acc must be fp32, got torch.bfloat16"):
        loops.adamw(p, (g, g, g), m, v, None, **kw)
    with pytest.raises(ValueError, match="takes no save or source"):
        loops.adamw(p, (g, g), m, v, None, save=(acc, acc, acc), **kw)
    with pytest.raises(ValueError, match="last grad must be a contiguous host tensor of 1000 elements"):
        loops.adamw(p, (g, g[:10]), m, v, None, **kw)
    assert torch.equal(p, torch.zeros(n)) and torch.equal(m, torch.zeros(n))  # nothing was changed
