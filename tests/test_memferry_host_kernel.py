"""The host AdamW kernels: the single-pass compiled loop equals torch's AdamW."""
from __future__ import annotations

import pytest
import torch

from strategies.memferry.config import AdamW
from strategies.memferry.host_kernel import SinglePassKernel, TorchKernel, make_host_kernel
from strategies.memferry.shadow import UnitShadow


def _shadow(n: int, low: torch.dtype, seed: int = 0) -> UnitShadow:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    work = master.to(low) if low != torch.float32 else master
    grad = torch.zeros(n)
    stage = torch.zeros(n, dtype=low) if low != torch.float32 else grad
    return UnitShadow(unit=None, work=work, master=master, exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                      grad=grad, grad_stage=stage, device_flat=None, offsets=[])


def _reference(master: torch.Tensor, grads: list[torch.Tensor], coefs: list[float], cfg: AdamW, lrs: list[float]):
    p = master.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    for g, c, lr in zip(grads, coefs, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = g.float() * c
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float32])
def test_single_pass_equals_torch_adamw(low):
    cfg = AdamW(lr=3e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.1, host_kernel="single-pass")
    n = 10_007  # not a multiple of any vector width
    s = _shadow(n, low)
    start = s.master.clone()
    k = SinglePassKernel(cfg)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(low) for _ in range(4)]
    coefs, lrs = [1.0, 0.5, 1.0, 0.25], [3e-3, 3e-3, 1e-3, 1e-3]
    for g, c, lr in zip(grads, coefs, lrs):
        k.set_lr(lr)
        s.grad_stage.copy_(g)
        phases = k.apply(s, c)
        assert set(phases) == {"upcast", "adamw", "call", "writeback", "backup"}
    p, m, v = _reference(start, grads, coefs, cfg, lrs)
    assert s.step == 4
    torch.testing.assert_close(s.master, p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s.exp_avg, m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.exp_avg_sq, v, rtol=1e-6, atol=1e-9)
    # the working copy is the master rounded to the compute dtype
    assert torch.equal(s.work, s.master.to(low))


def test_single_pass_matches_torch_kernel_bitwise_close_on_bf16():
    cfg = AdamW(lr=1e-3, weight_decay=0.01)
    a, b = _shadow(5000, torch.bfloat16), _shadow(5000, torch.bfloat16)
    ka, kb = SinglePassKernel(cfg), TorchKernel(cfg, [b])
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(5000, generator=gen).to(torch.bfloat16)
        a.grad_stage.copy_(g)
        b.grad_stage.copy_(g)
        ka.apply(a, 1.0)
        kb.apply(b, 1.0)
    torch.testing.assert_close(a.master, b.master, rtol=1e-6, atol=1e-6)
    assert a.step == b.step == 3
    # bf16 copies may differ only where the fp32 masters straddle a rounding boundary
    assert (a.work != b.work).float().mean() < 1e-3


def test_kernel_choice_and_errors():
    cfg = AdamW()
    # auto: the single pass where it compiles (this machine has a C++ compiler), see host_kernel.py
    assert isinstance(make_host_kernel("auto", cfg, [_shadow(10, torch.float32)]), SinglePassKernel)
    assert isinstance(make_host_kernel("auto", cfg, [_shadow(10, torch.bfloat16)]), SinglePassKernel)
    assert isinstance(make_host_kernel("single-pass", cfg, [_shadow(10, torch.bfloat16)]), SinglePassKernel)
    assert isinstance(make_host_kernel("torch", cfg, [_shadow(10, torch.bfloat16)]), TorchKernel)
    with pytest.raises(ValueError, match="unknown host kernel 'fast'"):
        make_host_kernel("fast", cfg, [])
    with pytest.raises(ValueError, match="host_kernel must be"):
        AdamW(host_kernel="fast")
    with pytest.raises(ValueError, match="host_threads"):
        AdamW(host_threads=0)


def test_engine_in_bf16_same_with_either_kernel(cpu_backend):
    """A bf16 MemFerry engine (host units updated by the compiled single pass) follows the
    engine with torch's three-pass kernel; the kernel in use is the one asked for."""
    import copy

    from strategies.models import build_model
    from strategies.memferry import MemFerry

    torch.manual_seed(0)
    model = build_model("gpt", layers=2, hidden=32, heads=4, vocab=64, seq=16, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    data = [(x, y)] * 6  # one batch again and again: the loss must fall
    runs = {}
    for kind in ("torch", "single-pass"):
        engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3, host_kernel=kind), plan="prefetch", backend=cpu_backend)
        assert engine.optimizer.kernel.name == kind
        runs[kind] = [engine.train_step(x, y).float().item() for x, y in data]
        engine.close()
    assert runs["single-pass"] == pytest.approx(runs["torch"], rel=2e-2)
    assert runs["torch"][-1] < runs["torch"][0]


def test_bf16_host_units_hold_16_bytes_per_parameter(cpu_backend):
    """Work copy 2 + fp32 master 4 + two moments 8 + gradient landing zone 2: the fp32
    gradient is only ever a chunk of scratch (TorchKernel), never a whole-unit buffer."""
    from strategies.models import build_model
    from strategies.memferry import MemFerry

    model = build_model("gpt", layers=2, hidden=32, heads=4, vocab=64, seq=16, dtype=torch.bfloat16)
    engine = MemFerry(model, optim=AdamW(), plan="prefetch", backend=cpu_backend)
    for s in engine.shadow.shadows:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (s.work, s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.grad_stage)}
        assert sum(storages.values()) == 16 * s.unit.numel
    engine.close()


def test_chunked_torch_kernel_equals_one_whole_update():
    cfg = AdamW(lr=1e-3, weight_decay=0.05)
    a, b = _shadow(10_001, torch.bfloat16), _shadow(10_001, torch.bfloat16)
    ka, kb = TorchKernel(cfg, [a], chunk=999), TorchKernel(cfg, [b], chunk=1 << 20)
    gen = torch.Generator().manual_seed(3)
    for coef in (1.0, 0.5, 1.0):
        g = torch.randn(10_001, generator=gen).to(torch.bfloat16)
        a.grad_stage.copy_(g)
        b.grad_stage.copy_(g)
        ka.apply(a, coef)
        kb.apply(b, coef)
    # elementwise, so equal up to the vector/scalar code paths at chunk edges (FMA vs not)
    for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)
    assert (a.work != b.work).float().mean() < 1e-3
    assert a.step == b.step == 3
