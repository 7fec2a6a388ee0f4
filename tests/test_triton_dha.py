"""xpu.triton_dha: the kernels on the CPU through Triton's interpreter (skipped where triton is
not installed; the GPU run is at the end of this file), and host_linear's choice of them."""
from __future__ import annotations

import os

import pytest
import torch

from tests.test_memferry_dha_linear import CHUNK, CountingBackend, close, host_tensor, make, reference, run
from xpu import CapabilityError, triton_dha

@pytest.fixture
def interpreted():
    """Triton's interpreter on CPU tensors (conftest.py chooses it for the whole session where
    there is no accelerator). fp32 only: the interpreter's bfloat16 is not faithful. Skips where
    triton is not installed, or runs compiled."""
    if not triton_dha.available():
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs compiled in this session (an accelerator is present): see the gpu tests below")


@pytest.mark.parametrize("m", [1, 5, 16, 128])
def test_read_once_matches_a_plain_matmul_for_both_operand_layouts(interpreted, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(70, 300, generator=g)  # [out, in], as a weight lies in host memory
    x, dy, bias = torch.randn(m, 300, generator=g), torch.randn(m, 70, generator=g), torch.randn(70, generator=g)
    close(triton_dha.mm_read_once(x, w.t(), bias), torch.addmm(bias, x, w.t()), 1e-5)  # forward: W^T, strided
    close(triton_dha.mm_read_once(dy, w), dy @ w, 1e-5)  # backward's dX: W as it lies


def test_write_once_fills_a_strided_slice_of_the_destination(interpreted):
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(40, 70, generator=g), torch.randn(40, 300, generator=g)
    out = torch.full((90, 300), 7.0)
    triton_dha.mm_write_once(dy.t(), x, out[10:80])  # dW rows 10..80, A transposed (strided)
    close(out[10:80], dy.t() @ x, 1e-5)
    assert (out[:10] == 7).all() and (out[80:] == 7).all()  # nothing written outside


def test_bad_operands_are_refused_before_any_launch():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(ValueError, match="more than MAX_ROWS"):
        triton_dha.mm_read_once(torch.randn(triton_dha.MAX_ROWS + 1, 8), b)
    with pytest.raises(ValueError, match=r"A \[M, K\] and B \[K, N\]"):
        triton_dha.mm_read_once(a, torch.randn(7, 3))
    with pytest.raises(TypeError, match="share one of"):
        triton_dha.mm_read_once(a, b.double())
    with pytest.raises(ValueError, match=r"out must be \[4, 3\]"):
        triton_dha.mm_write_once(a, b, torch.empty(3, 4))


@pytest.mark.parametrize("rows,grad_write", [(8, "auto"), (200, "dha")], ids=["in-place", "streamed-dha-write"])
def test_host_linear_with_triton_kernels_equals_the_reference(interpreted, cpu_backend, rows, grad_write):
    b = CountingBackend(cpu_backend, dha=True, async_copy=True, triton=True)
    w, x, bvec, dy = make(b, (rows,), True)
    got = run(b, w, x, bvec, dy, grad_out=True, chunk_bytes=CHUNK, kernels="triton", grad_write=grad_write)
    for g_, r in zip(got[:4], reference(w, x, bvec, dy)):
        close(g_, r)


def test_host_linear_auto_takes_triton_where_the_backend_has_it(monkeypatch, cpu_backend):
    calls = []

    def read(a, b, bias=None):
        calls.append("read")
        return torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)

    def write(a, b, out):
        calls.append("write")
        torch.mm(a, b, out=out)

    monkeypatch.setattr(triton_dha, "mm_read_once", read)
    monkeypatch.setattr(triton_dha, "mm_write_once", write)
    w, x, bvec, dy = make(cpu_backend, (8,), True)
    run(CountingBackend(cpu_backend, dha=True, triton=False), w, x, bvec, dy, grad_out=True)
    assert calls == []
    run(CountingBackend(cpu_backend, dha=True, triton=True), w, x, bvec, dy, grad_out=True)
    assert sorted(calls) == ["read", "read", "write"]  # forward, dX, dW


def test_triton_kernels_need_the_capability(cpu_backend):
    b = CountingBackend(cpu_backend, dha=True, triton=False)
    w, x, _, _ = make(b, (4,), False)
    from strategies.memferry.dha_linear import host_linear

    with pytest.raises(CapabilityError, match="caps.triton"):
        host_linear(b.to_device(x, 0), host_tensor(b, w), None, b, 0, kernels="triton")
    with pytest.raises(ValueError, match="kernels must be one of"):
        host_linear(b.to_device(x, 0), host_tensor(b, w), None, b, 0, kernels="cuda")
    assert b.h2d == 0


# ---------------------------------------------------------------------- on the GPU (pytest -m gpu)
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture
def triton_gpu(gpu_backend):
    """The GPU backend, where Triton runs on it (skips otherwise)."""
    if not gpu_backend.caps.triton:
        pytest.skip("no Triton on this GPU (caps.triton is False)")
    return gpu_backend


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 128, 4096])
def test_kernels_over_host_memory_match_fp32_in_bf16(triton_gpu, m):
    """Forward and dX read a pinned bf16 weight in place, dW is written into pinned memory in
    place: each within bf16 rounding of an fp32 reference (and dW leaves its neighbours alone)."""
    b = triton_gpu
    g = torch.Generator().manual_seed(m)
    w = torch.randn(1000, 768, generator=g) * 0.05
    w_host = b.host_arena.empty(w.shape, torch.bfloat16)
    w_host.copy_(w)
    view = b.device_view(w_host, 0)
    dev = b.device(0)
    x, dy = (torch.randn(m, k, generator=g).to(dev, torch.bfloat16) for k in (768, 1000))
    bias = torch.randn(1000, generator=g).to(dev, torch.bfloat16)
    wf = w_host.float().to(dev)
    if m <= triton_dha.MAX_ROWS:
        assert _rel(triton_dha.mm_read_once(x, view.t(), bias), x.float() @ wf.t() + bias.float()) < 1e-2
        assert _rel(triton_dha.mm_read_once(dy, view), dy.float() @ wf) < 1e-2
    g_host = b.host_arena.empty((1002, 768), torch.bfloat16)
    g_host.fill_(7)
    triton_dha.mm_write_once(dy.t(), x, b.device_view(g_host, 0)[1:1001])
    b.synchronize(0)
    assert _rel(g_host[1:1001].to(dev), dy.float().t() @ x.float()) < 1e-2
    assert (g_host[0] == 7).all() and (g_host[1001] == 7).all()


@pytest.mark.gpu
def test_host_linear_in_place_with_triton_equals_the_vendor_gemm(triton_gpu):
    b = triton_gpu
    from strategies.memferry.dha_linear import TransferCounter, host_linear

    g = torch.Generator().manual_seed(0)
    w_host = b.host_arena.empty((1000, 768), torch.bfloat16)
    w_host.copy_(torch.randn(1000, 768, generator=g) * 0.05)
    dev = b.device(0)
    x, dy = torch.randn(24, 768, generator=g).to(dev, torch.bfloat16), torch.randn(24, 1000, generator=g).to(dev, torch.bfloat16)
    out = {}
    for kernels in ("triton", "torch"):
        grad = b.host_arena.empty(w_host.shape, torch.bfloat16)
        xg = x.clone().requires_grad_()
        counter = TransferCounter()
        y = host_linear(xg, w_host, None, b, 0, grad, kernels=kernels, counter=counter)
        y.backward(dy)
        b.synchronize(0)
        assert counter.modes == {"dha/forward": 1, "dha/backward": 1} and counter.h2d_bytes == counter.d2h_bytes == 0
        out[kernels] = (y.float(), xg.grad.float(), grad.float().to(dev))
    for got, want in zip(out["triton"], out["torch"]):
        assert _rel(got, want) < 1e-2
