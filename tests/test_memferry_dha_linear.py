"""host_linear: a linear op whose weight lives in pinned host memory (strategies/memferry/dha_linear.py).

Numerics against F.linear and autograd (fp32, every mode), link traffic (each weight byte once
per forward and once per backward), device memory (two ring slots, not the weight), and input
checks. The cpu backend runs everything; ``-m gpu`` reruns the numerics on CUDA, where the ring
really overlaps copies with GEMMs and a missing event would show as wrong numbers.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from strategies.memferry.dha_linear import TransferCounter, choose_mode, host_linear
from xpu import CapabilityError

IN, OUT = 48, 70
ROW_BYTES = IN * 4
CHUNK = 16 * ROW_BYTES  # 16 rows per slot: 70 rows = 4 full chunks and one of 6


class CountingBackend:
    """Stands in for a backend: counts copy() bytes by direction and may hide capabilities."""

    def __init__(self, inner: Any, **caps: bool) -> None:
        self._inner = inner
        self._caps = replace(inner.caps, **caps)
        self.h2d = 0
        self.d2h = 0

    @property
    def caps(self):
        return self._caps

    def copy(self, dst, src, stream=None):
        nbytes = src.numel() * src.element_size()
        if self._inner.is_pinned(src):
            self.h2d += nbytes
        elif self._inner.is_pinned(dst):
            self.d2h += nbytes
        self._inner.copy(dst, src, stream)

    def device_view(self, host, device=None):
        if not self._caps.dha:
            raise CapabilityError("hidden by the test")
        return self._inner.device_view(host, device)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def host_tensor(b, t):
    out = b.host_arena.empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def dev_tensor(b, t):
    with b.device_scope(0):
        return b.to_device(t, 0)


def close(got, want, scale_tol=1e-6):
    """Equal within ``scale_tol`` of the reference's largest magnitude (at least 1): the chunked
    GEMMs sum in another order than one whole GEMM, so fp32 rounding differs by a few ulps of
    the largest terms (dW sums over every row of the batch, so it is the largest)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = scale_tol * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"max |difference| {err:.3g} > {bound:.3g}"


def tol(b):
    # cuBLAS may pick another reduction split for a chunk than for the whole GEMM.
    return 1e-6 if b.device_type == "cpu" else 1e-5


def make(b, lead, bias, seed=0, in_f=IN, out_f=OUT):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.1
    x = torch.randn(*lead, in_f, generator=g)
    bvec = torch.randn(out_f, generator=g) if bias else None
    dy = torch.randn(*lead, out_f, generator=g)
    return w, x, bvec, dy


def reference(w, x, bvec, dy):
    w, x = w.clone().requires_grad_(), x.clone().requires_grad_()
    bvec = bvec.clone().requires_grad_() if bvec is not None else None
    y = F.linear(x, w, bvec)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, (bvec.grad if bvec is not None else None)


def run(b, w, x, bvec, dy, *, grad_out=False, counter=None, **kw):
    """host_linear forward and backward; returns (y, dx, dw, db, grad_out tensor, ready events)."""
    wh = host_tensor(b, w)
    xd = dev_tensor(b, x).requires_grad_()
    bd = dev_tensor(b, bvec).requires_grad_() if bvec is not None else None
    gh = b.host_arena.empty(w.shape, w.dtype) if grad_out else None
    if gh is not None:
        gh.fill_(float("nan"))  # every element must be written
    stand_in = None if grad_out else b.empty(w.shape, w.dtype, 0).requires_grad_()
    events = []
    y = host_linear(xd, wh, bd, b, 0, gh, weight=stand_in, grad_ready=events.append, counter=counter, **kw)
    y.backward(dev_tensor(b, dy))
    b.synchronize(0)
    dw = gh if grad_out else stand_in.grad
    return (y.detach().cpu(), xd.grad.cpu(), dw.cpu(), bd.grad.cpu() if bd is not None else None, gh, events)


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("lead", [(1,), (64,), (65,), (5, 41), (3, 2, 11)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("grad_out", [True, False], ids=["grad_out", "device_grad"])
def test_matches_f_linear_and_autograd(backend, lead, bias, grad_out):
    b = backend
    w, x, bvec, dy = make(b, lead, bias)
    ref = reference(w, x, bvec, dy)
    counter = TransferCounter()
    y, dx, dw, db, gh, events = run(b, w, x, bvec, dy, grad_out=grad_out, counter=counter, chunk_bytes=CHUNK)
    rows = x.numel() // IN
    expected_mode = "dha" if rows <= 64 else "stream"
    assert counter.modes == {f"{expected_mode}/forward": 1, f"{expected_mode}/backward": 1}
    close(y, ref[0], tol(b))
    close(dx, ref[1], tol(b))
    close(dw, ref[2], tol(b))
    if bias:
        close(db, ref[3], tol(b))
    assert len(events) == (1 if grad_out else 0)


@pytest.mark.parametrize("mode", ["dha", "stream", "copy"])
def test_every_forced_mode_is_exact(backend, mode):
    b = backend
    w, x, bvec, dy = make(b, (37,), True, seed=3)
    ref = reference(w, x, bvec, dy)
    for grad_out in (True, False):
        y, dx, dw, db, *_ = run(b, w, x, bvec, dy, grad_out=grad_out, mode=mode, chunk_bytes=CHUNK)
        for got, want in zip((y, dx, dw, db), ref):
            close(got, want, tol(b))


@pytest.mark.parametrize("chunk_rows", [1, 7, 69, 70, 500])
def test_chunk_sizes_around_the_row_count(cpu_backend, chunk_rows):
    b = cpu_backend
    w, x, bvec, dy = make(b, (90,), True, seed=1)
    ref = reference(w, x, bvec, dy)
    got = run(b, w, x, bvec, dy, grad_out=True, chunk_bytes=chunk_rows * ROW_BYTES)
    for g, r in zip(got[:4], ref):
        close(g, r)


def test_host_weight_as_its_own_autograd_leaf_on_cpu(cpu_backend):
    """On the cpu backend host and device share a device type, so the host weight may take the grad."""
    b = cpu_backend
    w, x, bvec, dy = make(b, (100,), False)
    ref = reference(w, x, bvec, dy)
    wh = host_tensor(b, w).requires_grad_()
    xd = dev_tensor(b, x).requires_grad_()
    host_linear(xd, wh, None, b, 0, chunk_bytes=CHUNK).backward(dev_tensor(b, dy))
    close(wh.grad, ref[2])
    close(xd.grad, ref[1])


# ---------------------------------------------------------------------- capabilities
def _exact_with_gradient_home(b, rows):
    """Forward and backward of ``rows`` rows with the gradient written home, checked against
    the reference; the transfer counter and the weight's bytes."""
    w, x, bvec, dy = make(b, (rows,), True)
    ref = reference(w, x, bvec, dy)
    counter = TransferCounter()
    got = run(b, w, x, bvec, dy, grad_out=True, counter=counter, chunk_bytes=CHUNK)
    for g, r in zip(got[:4], ref):
        close(g, r)
    return counter, w.numel() * 4


def test_without_dha_or_async_copy_it_copies_then_multiplies(cpu_backend):
    b = CountingBackend(cpu_backend, dha=False, async_copy=False)
    assert choose_mode(1, b) == "copy" and choose_mode(10_000, b) == "copy"
    counter, wbytes = _exact_with_gradient_home(b, 8)
    assert counter.modes == {"copy/forward": 1, "copy/backward": 1}
    assert (b.h2d, b.d2h) == (2 * wbytes, wbytes)  # weight in twice, gradient home once, no DHA
    assert counter.dha_read_bytes == counter.dha_write_bytes == 0


def test_without_dha_gradient_goes_home_through_the_copy_ring(cpu_backend):
    b = CountingBackend(cpu_backend, dha=False, async_copy=True)
    assert choose_mode(1, b) == "stream"
    counter, wbytes = _exact_with_gradient_home(b, 5)
    assert (b.h2d, b.d2h) == (2 * wbytes, wbytes)
    assert (counter.h2d_bytes, counter.d2h_bytes) == (2 * wbytes, wbytes)


def test_dha_mode_needs_the_capability(cpu_backend):
    b = CountingBackend(cpu_backend, dha=False, async_copy=True)
    w, x, _, _ = make(b, (4,), False)
    with pytest.raises(CapabilityError, match="caps.dha"):
        host_linear(dev_tensor(b, x), host_tensor(b, w), None, b, 0, mode="dha")
    assert b.h2d == 0


# ---------------------------------------------------------------------- traffic and memory
@pytest.mark.parametrize("dha,grad_write", [(True, "auto"), (True, "dha"), (False, "auto")])
def test_streamed_path_moves_each_weight_byte_once_per_pass(cpu_backend, dha, grad_write):
    b = CountingBackend(cpu_backend, dha=dha, async_copy=True)
    w, x, bvec, dy = make(b, (4, 50), True)  # 200 rows: streamed
    wbytes = w.numel() * 4
    counter = TransferCounter()
    wh, gh = host_tensor(b, w), b.host_arena.empty(w.shape, w.dtype)
    xd = dev_tensor(b, x).requires_grad_()
    y = host_linear(xd, wh, dev_tensor(b, bvec), b, 0, gh, chunk_bytes=CHUNK, counter=counter, grad_write=grad_write)
    assert (b.h2d, b.d2h) == (wbytes, 0)  # forward: the weight, once
    y.backward(dev_tensor(b, dy))
    assert b.h2d == 2 * wbytes  # backward: the weight once more, for dX
    # the gradient once: a streamed pass takes it home through the copy ring unless told to write in place
    in_place = grad_write == "dha"
    assert b.d2h == (0 if in_place else wbytes)
    assert counter.dha_write_bytes == (wbytes if in_place else 0)
    close(gh, reference(w, x, bvec, dy)[2])
    assert counter.h2d_bytes == 2 * wbytes and counter.dha_read_bytes == 0


@pytest.mark.parametrize("rows", [8, 200], ids=["in-place", "streamed"])
def test_grad_write_ring_takes_the_gradient_home_by_copy_even_with_dha(cpu_backend, rows):
    """grad_write="ring" on a DHA backend: the gradient goes through the device ring and the
    copy stream (D2H bytes, no DHA writes), exactly as the DHA write would give it."""
    b = CountingBackend(cpu_backend, dha=True, async_copy=True)
    w, x, bvec, dy = make(b, (rows,), True)
    ref = reference(w, x, bvec, dy)
    counter = TransferCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a GEMM into a slot too small for it warns ("output ... resized")
        got = run(b, w, x, bvec, dy, grad_out=True, counter=counter, chunk_bytes=CHUNK, grad_write="ring")
    for g, r in zip(got[:4], ref):
        close(g, r)
    wbytes = w.numel() * 4
    assert b.d2h == wbytes and counter.d2h_bytes == wbytes and counter.dha_write_bytes == 0


def test_grad_write_is_checked_before_any_transfer(cpu_backend):
    b = CountingBackend(cpu_backend, dha=False, async_copy=True)
    w, x, _, _ = make(b, (4,), False)
    gh = b.host_arena.empty(w.shape, w.dtype)
    with pytest.raises(CapabilityError, match="grad_write 'dha'.*caps.dha"):
        host_linear(dev_tensor(b, x), host_tensor(b, w), None, b, 0, gh, grad_write="dha")
    with pytest.raises(ValueError, match="grad_write must be one of"):
        host_linear(dev_tensor(b, x), host_tensor(b, w), None, b, 0, gh, grad_write="copy")
    assert (b.h2d, b.d2h) == (0, 0)


def test_backward_without_dx_does_not_move_the_weight(cpu_backend):
    b = CountingBackend(cpu_backend)
    w, x, _, dy = make(b, (200,), False)
    wh, gh = host_tensor(b, w), b.host_arena.empty(w.shape, w.dtype)
    stand_in = b.empty(w.shape, w.dtype, 0).requires_grad_()  # only the weight needs a gradient
    y = host_linear(dev_tensor(b, x), wh, None, b, 0, gh, weight=stand_in, chunk_bytes=CHUNK)
    y.backward(dev_tensor(b, dy))
    assert b.h2d == w.numel() * 4  # the forward's pass only
    close(gh, reference(w, x, None, dy)[2])
    assert stand_in.grad is None  # the gradient went to grad_out


def test_small_batches_read_the_weight_in_place(cpu_backend):
    b = CountingBackend(cpu_backend)
    w, x, _, dy = make(b, (64,), False)
    counter = TransferCounter()
    run(b, w, x, None, dy, grad_out=True, counter=counter)
    wbytes = w.numel() * 4
    assert (b.h2d, b.d2h) == (0, 0)
    assert (counter.dha_read_bytes, counter.dha_write_bytes) == (2 * wbytes, wbytes)


def test_streamed_device_memory_is_two_chunks_not_the_weight(cpu_backend):
    b = cpu_backend
    in_f, out_f, rows, chunk_rows = 256, 1000, 80, 96
    w, x, bvec, dy = make(b, (rows,), True, in_f=in_f, out_f=out_f)
    wbytes = w.numel() * 4
    wh, gh = host_tensor(b, w), b.host_arena.empty(w.shape, w.dtype)
    xd = dev_tensor(b, x).requires_grad_()
    bd = dev_tensor(b, bvec).requires_grad_()
    dyd = dev_tensor(b, dy)
    slots = 2 * chunk_rows * in_f * 4
    b.reset_peak_memory(0)
    base = b.memory_stats(0).allocated
    y = host_linear(xd, wh, bd, b, 0, gh, chunk_bytes=chunk_rows * in_f * 4)
    forward_peak = b.memory_stats(0).peak_allocated - base
    y_bytes = rows * out_f * 4
    # y itself, two slots, and at most one GEMM temporary of a chunk's output columns.
    assert forward_peak <= y_bytes + slots + rows * chunk_rows * 4
    assert forward_peak - y_bytes < wbytes
    b.reset_peak_memory(0)
    base = b.memory_stats(0).allocated
    y.backward(dyd)
    backward_peak = b.memory_stats(0).peak_allocated - base
    # dX, dbias, two weight slots, two gradient slots (the ring takes dW home), temps
    assert backward_peak <= rows * in_f * 4 + out_f * 4 + 2 * slots + rows * chunk_rows * 4
    assert backward_peak < wbytes
    close(gh, reference(w, x, bvec, dy)[2])


# ---------------------------------------------------------------------- input checks
def test_bad_input_is_refused_before_any_copy(cpu_backend):
    b = CountingBackend(cpu_backend)
    w, x, bvec, _ = make(b, (100,), True)
    wh, xd, bd = host_tensor(b, w), dev_tensor(b, x), dev_tensor(b, bvec)
    cases = [
        (dict(x=dev_tensor(b, torch.randn(100, IN + 1))), ValueError, "in_features"),
        (dict(weight_host=torch.randn(OUT, IN)), ValueError, "pinned host memory"),  # pageable
        (dict(weight_host=dev_tensor(b, w)), ValueError, "pinned host memory"),  # on the device
        (dict(weight_host=host_tensor(b, torch.randn(IN, OUT)).t()), ValueError, "contiguous"),
        (dict(weight_host=host_tensor(b, torch.randn(OUT * IN))), ValueError, "2-D"),
        (dict(x=xd.double()), TypeError, "cast"),
        (dict(bias=dev_tensor(b, torch.randn(OUT + 1))), ValueError, "bias"),
        (dict(grad_out=b.host_arena.empty((IN, OUT), torch.float32)), ValueError, "grad_out"),
        (dict(grad_out=torch.empty(OUT, IN)), ValueError, "pinned"),
        (dict(weight=torch.empty(OUT + 1, IN)), ValueError, "weight_host's shape"),
        (dict(mode="fast"), ValueError, "mode"),
        (dict(chunk_bytes=0), ValueError, "chunk_bytes"),
        (dict(dha_max_rows=-1), ValueError, "dha_max_rows"),
    ]
    for override, error, message in cases:
        args = dict(x=xd, weight_host=wh, bias=bd, backend=b, device=0, chunk_bytes=CHUNK)
        args.update(override)
        with pytest.raises(error, match=message):
            host_linear(**args)
    assert (b.h2d, b.d2h) == (0, 0)


def test_a_host_leaf_weight_without_grad_out_is_refused_where_devices_differ(cpu_backend):
    """On a real device the weight's gradient would be a device tensor for a host leaf: refused."""
    b = CountingBackend(cpu_backend)
    b.device_type = "meta"  # device tensors are then not host tensors, as on a GPU
    wh = host_tensor(b, torch.randn(OUT, IN)).requires_grad_()
    with pytest.raises(ValueError, match="grad_out="):
        host_linear(torch.empty(3, IN, device="meta"), wh, None, b, 0)


# ---------------------------------------------------------------------- GPU stress
@pytest.mark.gpu
def test_cuda_ring_under_load_is_exact(gpu_backend):
    """Many small chunks and a long GEMM queue: any missing event would corrupt some rows."""
    b = gpu_backend
    # fp32: a few ulps of the largest term (sums of 3000-4096 products in another order);
    # bf16: a few bf16 roundings. A race (a chunk read before it lands, a slot refilled
    # under its GEMM) gives errors of the size of the values themselves.
    for dtype, scale_tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        w, x, bvec, dy = (t.to(dtype) if t is not None else None for t in make(b, (4096,), True, in_f=2048, out_f=3000))
        ref = [t.float() for t in reference(w.cuda().float(), x.cuda().float(), bvec.cuda().float(), dy.cuda().float())]
        for grad_out in (True, False):
            got = run(b, w, x, bvec, dy, grad_out=grad_out, chunk_bytes=97 * 2048 * w.element_size())
            for g, r in zip(got[:4], ref):
                close(g.float(), r.cpu(), scale_tol)
