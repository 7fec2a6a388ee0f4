"""The transfer engine and multi-path copier on a real CUDA device (``pytest -m gpu``).

Skipped by default and on machines without CUDA; run on the GPU machine with
``python -m pytest -q -m gpu tests/test_scaleup_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from scaleup import MultiPathCopier, TransferEngine

pytestmark = pytest.mark.gpu



def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_engine_round_trip_is_byte_exact(gpu_backend, dtype):
    b = gpu_backend
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 4097, (1 << 20) + 3, 9 << 20]
    host = []
    for n in sizes:
        raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
        host.append((raw & 1 if dtype == torch.bool else raw).view(dtype))
    pinned = [b.host_arena.empty(t.shape, t.dtype) for t in host]
    for p, t in zip(pinned, host):
        p.copy_(t)
    with TransferEngine(b, chunk_bytes=1 << 20) as eng:
        for group in (host, pinned):  # pageable (staged) and pinned (direct)
            h = eng.h2d(group, device=0)
            compute = b.current_stream(0)
            h.wait(compute)  # the compute stream orders itself after the data; host not blocked
            with b.use_stream(compute):
                sums = [_bytes(t).to(torch.int64).sum() for t in h.result]
            back = eng.d2h(h.result).synchronize()
            pageable_back = eng.d2h(h.result, out=[torch.empty_like(t) for t in host]).synchronize()
            for src, a, c, s in zip(host, back, pageable_back, sums):
                assert torch.equal(_bytes(a), _bytes(src)) and torch.equal(_bytes(c), _bytes(src))
                assert s.item() == _bytes(src).to(torch.int64).sum().item()
    for p in pinned:
        b.host_arena.release(p)


def test_engine_h2d_and_d2h_overlap(gpu_backend):
    b = gpu_backend
    n = 256 << 20
    src, dst = b.host_arena.empty(n), b.host_arena.empty(n)
    src.fill_(5)
    a, c = b.empty(n, torch.uint8, 0), b.empty(n, torch.uint8, 0)
    c.fill_(9)
    with TransferEngine(b) as eng:
        assert eng.stream("h2d", 0) is not eng.stream("d2h", 0)
        eng.h2d(src, out=a)
        eng.d2h(c, out=dst)
        eng.synchronize()
        assert torch.all(a == 5).item() and torch.all(dst == 9).item()
    b.host_arena.release(src)
    b.host_arena.release(dst)


def test_multipath_copier_is_byte_exact_on_cuda(gpu_backend):
    b = gpu_backend
    copier = MultiPathCopier(b, 0, chunk_bytes=4 << 20, probe=None)
    x = torch.randn(5_000_003)
    out = copier.h2d(x).synchronize()
    assert torch.equal(out.cpu(), x)
    if b.device_count() > 1 and b.caps.peer_access:
        assert len(copier.routes) > 1
    copier.close()
