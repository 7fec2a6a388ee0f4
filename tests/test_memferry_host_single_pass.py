"""The single-pass host AdamW (a C loop, :mod:`strategies.memferry.host_loops`) equals
torch.optim.AdamW on any unit size and split over threads, with and without a compiler;
accumulation sums micro-batches exactly.

Tolerance: the C loop rounds torch's fp32 arithmetic op for op (its multiply-adds fused where
ATen's vectorised kernels fuse them); torch's vectorised sqrt is not always correctly rounded,
so masters agree to rtol 1e-6 (a few fp32 ulps after several steps), moments to absolute
1e-7 / 1e-9; the bf16 working copy is bit-equal to the kernel's own master.to(bf16).
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from strategies.memferry import c_library, host_loops
from strategies.memferry.adamw import decay_ranges
from strategies.memferry.config import MIN_HOST_PIECE, AdamW
from strategies.memferry.host_kernel import SinglePassKernel, TorchKernel, make_host_kernel
from strategies.memferry.shadow import UnitShadow

C = 64  # torch kernel's chunk under test: sizes around it exercise whole chunks and tails
# 70007: the C loop splits it between two threads (each takes at least 32768 elements).
SIZES = [1, 7, C - 1, C, C + 1, 2 * C, 3 * C + 5, 70007]
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
    return SinglePassKernel(CFG, shadows, threads=2) if kind == "single-pass" else TorchKernel(CFG, shadows, chunk=C)


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


def test_the_loops_release_the_gil():
    """ctypes.CDLL (not PyDLL) drops the GIL for each call: the training thread keeps running
    while the host optimizer's worker updates (Inductor's kernels held it)."""
    import ctypes

    loops = host_loops.host_loops()
    assert type(loops._lib) is ctypes.CDLL


def test_auto_picks_single_pass_where_it_compiles_and_names_it():
    cfg = AdamW(host_kernel="auto")
    s = _shadow(10, torch.bfloat16, 10)
    k = make_host_kernel("auto", cfg, [s])
    assert isinstance(k, SinglePassKernel) and k.name == "single-pass"
    assert make_host_kernel("torch", cfg, [s]).name == "torch"


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """This machine without a C compiler (and nothing built in its cache)."""
    def missing():
        raise host_loops.UnavailableError("no C compiler found (set CC, or install gcc)")

    host_loops.clear_cache()
    monkeypatch.setenv("XPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(c_library, "compiler", missing)
    yield
    host_loops.clear_cache()


def test_without_a_compiler_auto_falls_back_to_torch(no_compiler, caplog):
    s = _shadow(3 * C + 5, torch.bfloat16, C, accumulate=True)
    with caplog.at_level("WARNING", logger="xpu.memferry"):
        k = make_host_kernel("auto", AdamW(), [s])
    assert isinstance(k, TorchKernel) and k.name == "torch"
    assert "single-pass host AdamW unavailable" in caplog.text and "no C compiler found" in caplog.text
    with pytest.raises(RuntimeError, match="could not be built here.*use host_kernel='torch'"):
        make_host_kernel("single-pass", AdamW(), [s])
    # the fallback still accumulates without the C loop, exactly
    g = torch.randn(s.master.numel()).to(torch.bfloat16)
    k.accumulate(s.grad_acc, g)
    assert torch.equal(s.grad_acc, g.float())


def test_auto_refuses_a_kernel_that_computes_wrong(monkeypatch, caplog):
    monkeypatch.setattr(host_loops.HostLoops, "adamw", lambda self, *a, **k: 0.0)  # runs nothing, in no time
    with caplog.at_level("WARNING", logger="xpu.memferry"):
        k = make_host_kernel("auto", AdamW(), [_shadow(10, torch.bfloat16, 10)])
    assert k.name == "torch" and "disagrees with torch.optim.AdamW" in caplog.text


def test_the_loop_runs_on_the_host_optimizer_thread_count(monkeypatch):
    """host_threads, not the training thread's intra-op count, sizes the loop's thread team."""
    seen, real = [], host_loops.HostLoops.adamw

    def adamw(self, *a, **kw):
        seen.append(kw["threads"])
        return real(self, *a, **kw)

    monkeypatch.setattr(host_loops.HostLoops, "adamw", adamw)
    s = _shadow(10, torch.bfloat16, 10)
    k = SinglePassKernel(AdamW(host_threads=3), [s])
    k.apply(s, 1.0)
    assert k.threads == 3 and seen == [3]


def test_the_loop_is_clocked_inside_its_call_and_the_rest_of_the_call_reads_as_call(monkeypatch):
    """``adamw`` is the loop's own seconds (clocked in C); what the call takes beyond them (its
    Python side, taking the GIL back) is ``call``, and the two add up to the whole call."""
    loops = host_loops.host_loops()
    s = _shadow(1 << 16, torch.bfloat16, 1 << 16)
    t0 = time.perf_counter()
    inside = loops.adamw(s.master, s.grad_stage, s.exp_avg, s.exp_avg_sq, s.work, grad_scale=1.0, decay=1.0,
                         beta1=0.9, beta2=0.999, bias_correction2_sqrt=1.0, eps=1e-8, step_size=1e-3, threads=1)
    assert 0.0 < inside <= time.perf_counter() - t0
    real = host_loops.HostLoops.adamw

    def adamw(self, *a, **kw):  # the real loop, then 50 ms outside it, reporting 1 ms inside
        real(self, *a, **kw)
        time.sleep(0.05)
        return 0.001

    monkeypatch.setattr(host_loops.HostLoops, "adamw", adamw)
    times = SinglePassKernel(AdamW(), [s]).apply(s, 1.0)
    assert times["adamw"] == 0.001 and times["call"] >= 0.05 - 0.001  # the sleep, less the 1 ms reported inside


def test_bad_tensors_are_one_line_errors():
    loops = host_loops.host_loops()
    acc, g = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^grad must be a contiguous host tensor of 8 elements, got \(4,\)"):
        loops.accumulate(acc, g[:4], 1)
    with pytest.raises(ValueError, match=r"^accumulate sums a 16-bit gradient into fp32, got torch.float32"):
        loops.accumulate(acc, acc.clone(), 1)
    with pytest.raises(ValueError, match=r"^exp_avg must be fp32, got torch.bfloat16$"):
        loops.adamw(acc, g, g, acc, None, grad_scale=1.0, decay=1.0, beta1=0.9, beta2=0.99,
                    bias_correction2_sqrt=1.0, eps=1e-8, step_size=1e-3, threads=1)


def test_squared_norm_is_the_exact_sum_to_fp32_accumulation_in_pieces_or_whole():
    from strategies.memferry.adamw import squared_norm

    t = torch.randn(100_000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) * 1e-3
    exact = t.double().square().sum().item()
    whole, pieces = squared_norm(t), squared_norm(t, chunk=4096)
    assert whole.dtype == pieces.dtype == torch.float64 and whole.dim() == 0
    assert whole.item() == pytest.approx(exact, rel=1e-5)
    assert pieces.item() == pytest.approx(exact, rel=1e-5)
    assert squared_norm(t, chunk=4096).item() == pieces.item()  # deterministic: every path gets the same bits
    assert squared_norm(t.double()).item() == pytest.approx(exact, rel=1e-12)  # fp64 gradients stay fp64
    assert squared_norm(torch.zeros(7)).item() == 0.0


def _ops_dispatched(fn) -> int:
    """How many aten ops ``fn()`` dispatches (each a launch on a device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_squared_norm_sum_adds_every_tensor_in_launches_that_do_not_grow_with_their_number():
    from strategies.memferry.adamw import squared_norm, squared_norm_sum

    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (3000, 17, 640, 5000)]
    grads.append(torch.randn(300, generator=gen))  # an fp32 sum made on the device: fp64 accumulation
    exact = sum(g.double().square().sum().item() for g in grads)
    total = squared_norm_sum(grads)
    assert total.dtype == torch.float64 and total.dim() == 0
    assert total.item() == pytest.approx(exact, rel=1e-6)
    assert total.item() == pytest.approx(sum(squared_norm(g).item() for g in grads), rel=1e-12)
    assert squared_norm_sum(grads).item() == total.item()  # deterministic
    assert squared_norm_sum(grads, chunk=1024).item() == pytest.approx(exact, rel=1e-6)  # large ones in pieces
    few = _ops_dispatched(lambda: squared_norm_sum(grads[:2]))
    assert _ops_dispatched(lambda: squared_norm_sum(grads[:4] * 6)) == few  # 24 gradients, as many launches as 2
    with pytest.raises(ValueError, match="at least one tensor"):
        squared_norm_sum([])


@pytest.mark.parametrize("work_dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("threads", [1, 3])
def test_save_and_from_forms_equal_the_in_place_update_bit_for_bit(work_dtype, threads):
    """The loop's three forms (in place; also saving the old state; reading the old state from a
    backup and writing the new one out of place, the speculative-clipping forms) give the same
    bits, on slices that start off any vector or cache-line boundary and cross the loop's tiles
    (its out-of-place stores are non-temporal and go out a tile at a time)."""
    loops = host_loops.host_loops()
    n, off = 70007, 3  # two threads' parts of ~35 k elements: each crosses many 512-element tiles
    gen = torch.Generator().manual_seed(11)
    base = [torch.randn(n + off, generator=gen) for _ in range(2)] + [torch.rand(n + off, generator=gen)]
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    kw = dict(grad_scale=0.5, decay=1 - 1e-3 * 0.1, beta1=0.9, beta2=0.99, bias_correction2_sqrt=0.3, eps=1e-8,
              step_size=1e-3, threads=threads)

    def run(form: str):
        p, m, v = (t.clone()[off:] for t in base)  # storage offset 3: no 16-byte alignment
        old = tuple(t.clone() for t in (p, m, v))
        work = None if work_dtype is None else torch.full((n + off,), 7.0, dtype=work_dtype)[off:]
        if form == "in place":
            loops.adamw(p, grad, m, v, work, **kw)
            return (p, m, v), work, None
        if form == "save":
            saved = tuple(torch.full((n + off,), -1.0)[off:] for _ in range(3))
            loops.adamw(p, grad, m, v, work, save=saved, **kw)
            return (p, m, v), work, (saved, old)
        spares = tuple(torch.full((n + off,), -1.0)[off:] for _ in range(3))  # new state into spares
        loops.adamw(*(spares[0], grad, spares[1], spares[2]), work, source=(p, m, v), **kw)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), old))  # the source is only read
        return spares, work, None

    (want, want_work, _), (saved_state, saved_work, (saved, old)), (spare_state, spare_work, _) = (
        run("in place"), run("save"), run("from"))
    assert not torch.equal(want[0], base[0][off:])  # the update changed the master
    for got in (saved_state, spare_state):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(saved, old))  # the backup holds the old state exactly
    if work_dtype is not None:
        assert torch.equal(want_work, want[0].to(work_dtype))
        assert torch.equal(saved_work, want_work) and torch.equal(spare_work, want_work)


def _team_inputs(seed: int = 3, n: int = 300_001):
    gen = torch.Generator().manual_seed(seed)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    v, g = torch.rand(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    return p, m, v, g, torch.empty(n, dtype=torch.bfloat16)


def _team_update(threads: int, inputs=None):
    """One in-place update of 300,001 elements split over ``threads`` (the loop's kept team)."""
    p, m, v, g, work = inputs if inputs is not None else _team_inputs()
    host_loops.host_loops().adamw(p, g, m, v, work, grad_scale=1.0, decay=1 - 1e-4, beta1=0.9, beta2=0.99,
                                  bias_correction2_sqrt=0.5, eps=1e-8, step_size=1e-3, threads=threads)
    return p, m, v, work


def test_the_kept_thread_team_gives_every_call_its_whole_result():
    """The loop keeps its worker threads between calls: calls with more, fewer and again more
    threads, and calls from two Python threads at once, each get every element updated exactly as
    one thread updates them."""
    import threading

    ref = _team_update(1)
    for threads in (7, 2, 9, 4, 9):
        for a, b in zip(_team_update(threads), ref):
            assert torch.equal(a, b), threads
    results = {}

    def worker(k):
        results[k] = [_team_update(5 + k) for _ in range(5)]

    callers = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    for runs in results.values():
        for run in runs:
            for a, b in zip(run, ref):
                assert torch.equal(a, b)


def test_a_forked_child_runs_the_loop_with_a_team_of_its_own():
    """A child forked after the parent's team started (a data loader worker) has none of its
    threads: its calls start their own instead of waiting on the parent's forever. (The child
    makes no large tensors itself: torch's own OpenMP pool does not survive a fork.)"""
    import multiprocessing as mp

    _team_update(6)  # the parent's team exists
    inputs = _team_inputs()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_update, args=(queue, inputs))
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) == _team_update(1)[0][:1000].tolist()


def _child_update(queue, inputs) -> None:
    queue.put(_team_update(6, inputs)[0][:1000].tolist())


def test_a_build_is_cached_by_its_source_and_the_local_headers_it_includes(tmp_path, monkeypatch):
    """Editing a header a C source includes builds again: the cache key covers it (host_loops.c
    includes host_team.h)."""
    import ctypes

    monkeypatch.setenv("XPU_CACHE_DIR", str(tmp_path / "cache"))
    src, header = tmp_path / "lib.c", tmp_path / "value.h"
    src.write_text('#include "value.h"\nint xpu_value(void) { return VALUE; }\n')
    header.write_text("#define VALUE 1\n")
    try:
        first = c_library.build(src, ["-O1", "-fPIC", "-shared"], [[]])
    except c_library.UnavailableError as exc:
        pytest.skip(f"no C compiler: {exc}")
    assert c_library.build(src, ["-O1", "-fPIC", "-shared"], [[]]) == first  # cached
    header.write_text("#define VALUE 2\n")
    second = c_library.build(src, ["-O1", "-fPIC", "-shared"], [[]])
    assert second != first
    assert (ctypes.CDLL(str(first)).xpu_value(), ctypes.CDLL(str(second)).xpu_value()) == (1, 2)
    assert host_loops._SOURCE.with_name("host_team.h").read_text() in c_library.source_text(host_loops._SOURCE)


def test_host_piece_sets_the_calls_of_an_update_and_leaves_its_bits():
    """``AdamW.host_piece`` cuts each weight-decay group into calls of that many parameters (the
    worker answers between them): the same bits as one call per group."""
    n = 3 * MIN_HOST_PIECE + 14  # each weight-decay group 1.5 pieces and 7 parameters: two calls each
    cut, whole = (_shadow(n, torch.bfloat16, n // 2, seed=1) for _ in range(2))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for s in (cut, whole):
        s.grad_stage.copy_(grad)
    small = SinglePassKernel(dataclasses.replace(CFG, host_piece=MIN_HOST_PIECE), [cut], threads=2)
    assert small.piece == MIN_HOST_PIECE and SinglePassKernel(CFG, [whole], threads=2).piece == 1 << 24
    assert len(list(small.pieces(cut, 0.5))) == 4
    SinglePassKernel(CFG, [whole], threads=2).apply(whole, 0.5)
    for a, b in ((cut.master, whole.master), (cut.exp_avg, whole.exp_avg), (cut.exp_avg_sq, whole.exp_avg_sq),
                 (cut.work, whole.work)):
        assert torch.equal(a, b)
    assert cut.step == whole.step == 1


@pytest.mark.parametrize("bad", [1000, MIN_HOST_PIECE - 1, 2.5e6, True, "16M"])
def test_a_host_piece_too_small_or_not_a_count_is_refused(bad):
    with pytest.raises(ValueError, match=r"host_piece must be a whole number of parameters, at least 65536"):
        AdamW(host_piece=bad)


def test_a_last_sliver_joins_the_piece_before_it():
    """A group's last piece under an eighth of ``host_piece`` joins the one before it (one call's
    return fewer: a 50 M unit cut at 2**24 made a fourth call for its last 27 k parameters); the
    bits are those of one call per group."""
    p, n = MIN_HOST_PIECE, 2 * MIN_HOST_PIECE + 100
    assert decay_ranges(n, n, p, tail=p // 8) == [(0, p, True), (p, n, True)]
    assert len(decay_ranges(2 * p + 9000, 0, p, tail=p // 8)) == 3  # an eighth or more stays
    cut, whole = (_shadow(n, torch.bfloat16, n, seed=3) for _ in range(2))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for s in (cut, whole):
        s.grad_stage.copy_(grad)
    small = SinglePassKernel(dataclasses.replace(CFG, host_piece=MIN_HOST_PIECE), [cut], threads=2)
    assert len(list(small.pieces(cut, 1.0))) == 2
    SinglePassKernel(CFG, [whole], threads=2).apply(whole, 1.0)
    assert all(torch.equal(a, b) for a, b in ((cut.master, whole.master), (cut.exp_avg, whole.exp_avg),
                                              (cut.exp_avg_sq, whole.exp_avg_sq), (cut.work, whole.work)))
