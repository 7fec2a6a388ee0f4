"""The single-pass host AdamW (compiled once for a fixed chunk) equals torch.optim.AdamW on any
unit size, with and without a compiler; accumulation sums micro-batches exactly.

Tolerance: the compiled loop and torch's ops round the same fp32 arithmetic, differing only
where one contracts a multiply-add into an FMA, so masters agree to rtol 1e-6 (a few fp32
ulps after several steps), moments to absolute 1e-7 / 1e-9 (an ulp of the gradient-sized
terms they sum); the bf16 working copy is bit-equal to the kernel's own master.to(bf16).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strategies.memferry import host_loops
from strategies.memferry.config import AdamW
from strategies.memferry.host_kernel import SinglePassKernel, TorchKernel, make_host_kernel
from strategies.memferry.shadow import UnitShadow

C = 64  # row length of the kernels under test: sizes around it exercise whole rows, tails, scratch only
SIZES = [1, 7, C - 1, C, C + 1, 2 * C, 3 * C + 5]
CFG = AdamW(lr=3e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.1)


def _shadow(n: int, low: torch.dtype, decay: int, seed: int = 0, accumulate: bool = False) -> UnitShadow:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    work = master.to(low) if low != torch.float32 else master
    stage = torch.zeros(n, dtype=low)
    unit = SimpleNamespace(decay_numel=decay, train_numel=n, name="u")
    s = UnitShadow(unit=unit, work=work, master=master, exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                   grad=stage, grad_stage=stage, device_flat=None, offsets=[])
    if accumulate:
        s.grad_acc = torch.zeros(n)
    return s


def _kernel(kind: str, shadows: list[UnitShadow]):
    return SinglePassKernel(CFG, shadows, chunk=C) if kind == "single-pass" else TorchKernel(CFG, shadows, chunk=C)


def _reference(start: torch.Tensor, decay: int, grads: list[torch.Tensor], coefs, lrs):
    """torch.optim.AdamW (its default, single-tensor path) with a decay and a no-decay group."""
    parts = [start[:decay].clone(), start[decay:].clone()]
    opt = torch.optim.AdamW([{"params": [parts[0]]}, {"params": [parts[1]], "weight_decay": 0.0}],
                            lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay)
    for g, c, lr in zip(grads, coefs, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        full = g.float() * c
        parts[0].grad, parts[1].grad = full[:decay].clone(), full[decay:].clone()
        opt.step()
    state = [opt.state[p] for p in parts]
    return (torch.cat(parts), torch.cat([s["exp_avg"] for s in state]), torch.cat([s["exp_avg_sq"] for s in state]))


def _check(s: UnitShadow, ref, low: torch.dtype) -> None:
    p, m, v = ref
    torch.testing.assert_close(s.master, p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.exp_avg, m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.exp_avg_sq, v, rtol=1e-6, atol=1e-9)
    if low != torch.float32:
        assert torch.equal(s.work, s.master.to(low))


@pytest.mark.parametrize("kind", ["single-pass", "torch"])
@pytest.mark.parametrize("n", SIZES)
def test_kernel_equals_torch_adamw_on_any_unit_size(kind, n):
    decay = (2 * n) // 3  # a decay group and a no-decay group, the boundary inside a chunk
    s = _shadow(n, torch.bfloat16, decay, seed=n)
    start = s.master.clone()
    k = _kernel(kind, [s])
    gen = torch.Generator().manual_seed(100 + n)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(4)]
    coefs, lrs = [1.0, 0.5, 1.0, 0.25], [3e-3, 3e-3, 1e-3, 1e-3]
    for g, c, lr in zip(grads, coefs, lrs):
        k.set_lr(lr)
        s.grad_stage.copy_(g)
        k.apply(s, c)
    assert s.step == 4
    _check(s, _reference(start, decay, grads, coefs, lrs), torch.bfloat16)


@pytest.mark.parametrize("kind", ["single-pass", "torch"])
@pytest.mark.parametrize("n", SIZES)
def test_accumulated_micro_batches_update_from_their_exact_fp32_sum(kind, n):
    s = _shadow(n, torch.bfloat16, n, seed=n, accumulate=True)
    start = s.master.clone()
    k = _kernel(kind, [s])
    gen = torch.Generator().manual_seed(7)
    sums = []
    for _ in range(2):  # two optimizer steps of three micro-batches
        micro = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(3)]
        s.grad_acc.copy_(micro[0])
        for g in micro[1:]:
            k.accumulate(s.grad_acc, g)
        expect = micro[0].float() + micro[1].float() + micro[2].float()
        assert torch.equal(s.grad_acc, expect)  # one fp32 rounding per add, as torch's own
        sums.append(expect)
        s.accumulated = True
        k.apply(s, 1.0)
    _check(s, _reference(start, n, sums, [1.0, 1.0], [CFG.lr, CFG.lr]), torch.bfloat16)


def test_fp32_compute_master_is_the_working_copy():
    n = 3 * C + 5
    s = _shadow(n, torch.float32, n // 2)
    assert s.master_is_work
    start = s.master.clone()
    k = _kernel("single-pass", [s])
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    for g in grads:
        s.grad_stage.copy_(g)
        k.apply(s, 1.0)
    _check(s, _reference(start, n // 2, grads, [1.0] * 3, [CFG.lr] * 3), torch.float32)


def test_no_recompile_for_any_unit_size():
    """Compiled once per dtype combination: sizes, offsets and decay boundaries reuse it."""
    from torch._dynamo.utils import counters

    import threading

    shadows = [_shadow(n, torch.bfloat16, n // 3, seed=n, accumulate=True) for n in SIZES]
    with torch.no_grad():  # built under another grad mode than the worker thread's (a Dynamo guard)
        k = _kernel("single-pass", shadows)
    before = dict(counters["stats"]).get("unique_graphs", 0)

    def updates() -> None:  # in a worker thread, as HostOptimizer runs them
        for s in shadows:
            s.grad_stage.normal_()
            k.apply(s, 0.5)
            k.accumulate(s.grad_acc, s.grad_stage)
            s.accumulated = True
            k.apply(s, 1.0)

    worker = threading.Thread(target=updates)
    worker.start()
    worker.join()
    assert all(s.step == 2 for s in shadows)
    assert dict(counters["stats"]).get("unique_graphs", 0) == before


def test_auto_picks_single_pass_where_it_compiles_and_names_it():
    cfg = AdamW(host_kernel="auto")
    s = _shadow(10, torch.bfloat16, 10)
    k = make_host_kernel("auto", cfg, [s])
    assert isinstance(k, SinglePassKernel) and k.name == "single-pass"
    assert make_host_kernel("torch", cfg, [s]).name == "torch"


@pytest.fixture
def no_compiler(monkeypatch):
    """This machine without a C++ compiler: compiled loops fail on their first call, as Inductor does."""
    def compile_(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("InductorError: CppCompileError: C++ compile error: g++: not found")
        return run

    host_loops.clear_cache()
    monkeypatch.setattr(torch, "compile", compile_)
    yield
    host_loops.clear_cache()


def test_without_a_compiler_auto_falls_back_to_torch(no_compiler, caplog):
    s = _shadow(3 * C + 5, torch.bfloat16, C, accumulate=True)
    with caplog.at_level("WARNING", logger="xpu.memferry"):
        k = make_host_kernel("auto", AdamW(), [s])
    assert isinstance(k, TorchKernel) and k.name == "torch"
    assert "single-pass host AdamW unavailable" in caplog.text and "g++: not found" in caplog.text
    with pytest.raises(RuntimeError, match="could not be compiled here.*use host_kernel='torch'"):
        make_host_kernel("single-pass", AdamW(), [s])
    # the fallback still accumulates without the compiled loop, exactly
    g = torch.randn(s.master.numel()).to(torch.bfloat16)
    k.accumulate(s.grad_acc, g)
    assert torch.equal(s.grad_acc, g.float())


def test_auto_refuses_a_kernel_that_computes_wrong(monkeypatch, caplog):
    monkeypatch.setattr(host_loops.ChunkLoop, "__call__", lambda self, tensors, extra=(): None)
    with caplog.at_level("WARNING", logger="xpu.memferry"):
        k = make_host_kernel("auto", AdamW(), [_shadow(10, torch.bfloat16, 10)])
    assert k.name == "torch" and "disagrees with torch.optim.AdamW" in caplog.text


def test_compiled_code_uses_the_host_optimizer_thread_count(monkeypatch):
    """The OpenMP team size is fixed when Inductor compiles: it must be host_threads, not the
    compiling (training) thread's count."""
    seen, real = [], torch.compile

    def compile_(fn, **kw):
        seen.append(kw.get("options", {}).get("cpp.threads"))
        return real(fn, **kw)

    host_loops.clear_cache()
    monkeypatch.setattr(torch, "compile", compile_)
    k = SinglePassKernel(AdamW(host_threads=1), [_shadow(10, torch.bfloat16, 10)], chunk=C)
    assert k.threads == 1 and seen == [1]
