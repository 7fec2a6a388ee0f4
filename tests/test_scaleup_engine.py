"""The transfer engine on the cpu reference backend: byte-exact copies, staging, handles, bad input."""
from __future__ import annotations

import random

import pytest
import torch

from scaleup import TransferEngine, TransferError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # Random bytes reinterpreted, so every bit pattern (NaNs included) must survive.
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def engine(cpu_backend):
    eng = TransferEngine(cpu_backend, chunk_bytes=4097)  # odd chunk: ranges straddle tensor ends
    yield eng
    eng.close()


def test_round_trips_random_sizes_dtypes_pinned_and_pageable(cpu_backend, engine):
    gen = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    arena = cpu_backend.host_arena
    for trial in range(12):
        group, pinned_copies = [], []
        for _ in range(rnd.randint(1, 5)):
            numel = rnd.choice([0, 1, 3, 1023, 4096, 9999, rnd.randint(0, 20000)])
            t = _random(numel, rnd.choice(DTYPES), gen)
            if rnd.random() < 0.5:  # pinned source
                p = arena.empty(t.shape, t.dtype)
                p.copy_(t)
                pinned_copies.append(p)
                t = p
            group.append(t)
        device = rnd.randrange(cpu_backend.device_count())
        dev = engine.h2d(group, device=device).synchronize()
        assert len(dev) == len(group)
        pageable_out = [torch.empty_like(t) for t in group]
        back = engine.d2h(dev, out=pageable_out).synchronize()  # pageable: staged
        pinned_back = engine.d2h(dev).synchronize()  # default: new pinned tensors
        for src, a, c in zip(group, back, pinned_back):
            assert _same_bytes(src, a) and _same_bytes(src, c)
            assert cpu_backend.is_pinned(c) or c.numel() == 0
        for p in pinned_copies:
            arena.release(p)


def test_single_tensor_and_scalar_keep_shape(cpu_backend, engine):
    x = torch.randn(3, 5, 7)
    s = torch.tensor(2.5, dtype=torch.float64)
    t = engine.h2d(x, device=1)
    assert t.result.shape == (3, 5, 7)
    assert torch.equal(t.synchronize(), x)
    assert engine.h2d(s).synchronize().item() == 2.5
    assert engine.h2d([]).synchronize() == []


def test_h2d_result_is_counted_on_the_target_device(cpu_backend, engine):
    before = cpu_backend.memory_stats(2).allocated
    out = engine.h2d(torch.zeros(1 << 16), device=2).synchronize()
    assert cpu_backend.memory_stats(2).allocated == before + out.numel() * 4


def test_into_given_out_and_handle_states(cpu_backend, engine):
    out = cpu_backend.empty((1000,), torch.int64, 0)
    src = torch.arange(1000)
    t = engine.h2d(src, device=0, out=out)
    t.wait(cpu_backend.stream(0))  # a compute stream orders itself after the data
    t.wait()
    assert t.synchronize() is out and torch.equal(out, src) and t.done()
    assert t.nbytes == 8000 and "done" in repr(t)


def test_staging_is_double_buffered_and_from_the_arena(cpu_backend):
    arena = cpu_backend.host_arena
    before = arena.stats().in_use
    with TransferEngine(cpu_backend, chunk_bytes=1 << 12, staging_slots=2) as eng:
        x = torch.randint(0, 100, (1 << 16,), dtype=torch.uint8)  # 16 chunks through 2 buffers
        assert torch.equal(eng.h2d(x).synchronize(), x)
        assert arena.stats().in_use - before == 2 * (1 << 12)
    assert arena.stats().in_use == before  # close() gave the staging back


@pytest.mark.parametrize("make, message", [
    (lambda b: torch.randn(8, 8).t(), "not contiguous.*contiguous\\(\\)"),
    (lambda b: "tensor", "tensor or a list"),
    (lambda b: [torch.zeros(2), 3], r"src\[1\] is a int"),
    (lambda b: torch.randn(4).to_sparse(), "layout"),
])
def test_bad_input_is_refused_before_anything_moves(cpu_backend, engine, make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine.h2d(make(cpu_backend))
    assert engine._workers == {} and engine._inflight == []


def test_mismatched_out_is_refused(cpu_backend, engine):
    with pytest.raises(ValueError, match=r"out\[0\] is \(3,\) torch.float32 but src\[0\] is \(4,\) torch.float32"):
        engine.h2d(torch.zeros(4), out=cpu_backend.empty(3, torch.float32, 0))
    with pytest.raises(ValueError, match="has 1 tensors for 2"):
        engine.h2d([torch.zeros(1), torch.zeros(1)], out=[cpu_backend.empty(1, torch.float32, 0)])
    with pytest.raises(ValueError, match="out of range"):
        engine.h2d(torch.zeros(1), device=99)


def test_bad_engine_settings():
    with pytest.raises(ValueError, match="chunk_bytes"):
        TransferEngine(chunk_bytes=0)
    with pytest.raises(ValueError, match="staging_slots"):
        TransferEngine(chunk_bytes=10, staging_slots=0)


def test_an_error_on_the_handle_surfaces_as_transfer_error(cpu_backend, engine):
    out = cpu_backend.empty(64, torch.uint8, 0)
    src = torch.zeros(64, dtype=torch.uint8)
    t = engine.h2d(src, out=out)
    t.synchronize()
    bad = engine.h2d(src, out=out)
    bad._fail(RuntimeError("boom"))
    with pytest.raises(TransferError, match="boom"):
        bad.synchronize()


def test_closed_engine_refuses_work(cpu_backend):
    eng = TransferEngine(cpu_backend)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.h2d(torch.zeros(1))
