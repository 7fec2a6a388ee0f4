"""Selective recomputation (``strategies/selective_recompute.py``): gradients equal to a plain
forward's, the kept bytes counted exactly, and a MemFerry step's device peak between keeping
every activation and recomputing them all."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.models import build_model
from strategies.selective_recompute import kept_output_bytes, keeps_output, selective_checkpoint


def _saved(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What a plain forward of ``block`` saves for backward, each storage once, parameters left out."""
    saved: dict[int, torch.Tensor] = {}
    own = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return list(saved.values())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gradients_equal_a_plain_forward(family):
    torch.manual_seed(0)
    block = build_model(family, layers=1, hidden=64, heads=4, vocab=100, seq=32).blocks[0]
    x = torch.randn(2, 32, 64, requires_grad=True)
    g = torch.randn(2, 32, 64)
    wrt = [x, *block.parameters()]
    plain = torch.autograd.grad(block(x), wrt, g)
    selective = torch.autograd.grad(selective_checkpoint(block, x), wrt, g)
    for a, b in zip(plain, selective):
        assert torch.equal(a, b)  # the same ops on the same inputs: bit-equal
    # it keeps under 80 % of what a plain forward saves (GPT: 62 %; Llama's SwiGLU and RMSNorm: 30 %)
    assert kept_output_bytes(lambda: block(x)) < 0.8 * sum(t.untyped_storage().nbytes() for t in _saved(block, x))


def test_kept_bytes_are_the_matmuls_outputs():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(5, 8)
    # two addmm outputs, fp32: 5 x 32 and 5 x 8; the GELU's output is recomputed, not kept
    assert kept_output_bytes(lambda: mlp(x)) == 4 * (5 * 32 + 5 * 8)
    assert keeps_output(torch.ops.aten.mm.default) and not keeps_output(torch.ops.aten.gelu.default)
    assert keeps_output(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def test_kept_bytes_count_outputs_whose_address_a_later_one_reuses():
    """Without a graph each matmul's output dies at the next op, and the allocator hands its
    address to the next matmul's output: every output still counts (the count had merged them)."""
    w = torch.randn(64, 64)

    def chain():
        y = torch.randn(16, 64)
        for _ in range(6):
            y = torch.tanh(y @ w)  # the product is freed once tanh has read it
        return y

    assert kept_output_bytes(chain) == 6 * 16 * 64 * 4


def test_a_plan_is_refused_when_selective_lacks_recompute_or_meets_dha():
    with pytest.raises(ValueError, match="set recompute=True too"):
        UnitPlan("prefetch", "prefetch", selective=True)
    with pytest.raises(ValueError, match="selective recompute is for resident and prefetched units"):
        UnitPlan("dha", "prefetch", recompute=True, selective=True)
    assert Plan.from_spec("device2+selective", 3).units[0] == UnitPlan("resident", "resident", True, "device", selective=True)
    assert Plan.from_spec("prefetch+selective", 2).units[1].activations == "selective"
    with pytest.raises(ValueError, match="unknown plan 'dha\\+selective'"):
        Plan.from_spec("dha+selective", 2)


def _step_peak(backend, model, plan, x, y) -> tuple[int, float]:
    """What a step adds to the device's allocated bytes at its peak, and its loss."""
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3), plan=plan, backend=backend)
    engine.train_step(x, y)  # the first step allocates the engine's lasting buffers
    engine.synchronize()
    before = backend.memory_stats(0).allocated
    backend.reset_peak_memory(0)
    loss = engine.train_step(x, y).item()
    engine.synchronize()
    peak = backend.memory_stats(0).peak_allocated - before
    engine.close()
    return peak, loss


def test_a_memferry_step_peaks_between_keeping_and_recomputing(cpu_backend):
    torch.manual_seed(0)
    model = build_model("llama", layers=3, hidden=64, heads=4, vocab=128, seq=64)
    x, y = torch.randint(0, 128, (4, 64)), torch.randint(0, 128, (4, 64))
    peaks = {}
    for base in ("device3", "prefetch"):
        peaks, losses = {}, set()
        for name in ("keep", "selective", "recompute"):
            spec = base + ("" if name == "keep" else "+" + name)
            peaks[name], loss = _step_peak(cpu_backend, model, Plan.from_spec(spec, 3), x, y)
            losses.add(loss)
        assert len(losses) == 1  # the same training step whatever is kept
        assert peaks["keep"] > peaks["selective"] > peaks["recompute"], (base, peaks)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gradients_equal_a_plain_forward_on_the_gpu_in_bf16(family):
    """bf16 with the fused attention kernels the GPU picks: kept and recomputed alike, bit-equal."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    block = build_model(family, layers=1, hidden=1024, heads=8, vocab=100, seq=512).blocks[0].to(dev, torch.bfloat16)
    x = torch.randn(4, 512, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    wrt = [x, *block.parameters()]
    plain = torch.autograd.grad(block(x), wrt, g)
    selective = torch.autograd.grad(selective_checkpoint(block, x), wrt, g)
    for a, b in zip(plain, selective):
        assert torch.equal(a, b)
    assert kept_output_bytes(lambda: block(x)) < 0.8 * sum(  # fewer bytes than a plain forward saves
        t.untyped_storage().nbytes() for t in _saved(block, x))



def test_the_scheduler_drops_selective_recompute_where_it_is_no_faster_than_recomputing_all():
    from strategies.memferry.cost import Links
    from strategies.memferry.profiler import BlockProfile, StepProfile
    from strategies.memferry.scheduler import prune_choices, unit_choices

    def profile(bwd_selective_s: float) -> StepProfile:
        # fwd 1 ms, bwd 2 ms: recomputing everything costs 4 ms forward and backward
        block = BlockProfile(10**6, 2 * 10**6, 1e-3, 2e-3, 10**8, 10**6, 0, 4 * 10**7, bwd_selective_s, 1.2e-3)
        return StepProfile([block] * 3, 10**6, 2 * 10**6, 1e-3, 1e-3, 10**7, 1000, 2, 1024, 1e-9, 1e-11)

    links = Links(50, 50, None, ())
    choices = unit_choices(allow_dha=False)
    # the H200's Qwen2 layer: a selective backward slower than forward + backward again
    assert not any(c.selective for c in prune_choices(choices, profile(3.0e-3), links))
    kept = [c for c in prune_choices(choices, profile(2.4e-3), links) if c.selective]
    assert len(kept) == 3  # resident (host or device optimizer) and prefetched
    older = dataclasses.replace(profile(2.4e-3))  # written before selective was measured
    older.blocks = [dataclasses.replace(b, act_bytes_selective=0) for b in older.blocks]
    assert not any(c.selective for c in prune_choices(choices, older, links))
