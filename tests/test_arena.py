"""The pinned host arena: exact sizes, reuse, budget."""
from __future__ import annotations

import pytest
import torch

from xpu import HostArena, HostMemoryBudgetError


class CountingBackend:
    """Records raw allocations so tests see exactly what the arena asked for."""

    def __init__(self):
        self.allocs, self.frees = [], []

    def alloc_pinned(self, nbytes):
        self.allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_pinned(self, buf):
        self.frees.append(buf.numel())


def test_exact_sizes_and_typed_views():
    raw = CountingBackend()
    arena = HostArena(raw)
    t = arena.empty((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert raw.allocs == [30]  # no power-of-two rounding
    assert arena.stats().in_use == 30


def test_release_then_same_size_reuses_without_allocating():
    raw = CountingBackend()
    arena = HostArena(raw)
    a = arena.empty(1000)
    ptr = a.data_ptr()
    arena.release(a)
    b = arena.empty((250,), torch.float32)
    assert b.data_ptr() == ptr and raw.allocs == [1000]
    stats = arena.stats()
    assert (stats.allocations, stats.reuses, stats.in_use, stats.cached) == (1, 1, 1000, 0)
    c = arena.empty(999)  # a different size is a new allocation
    assert raw.allocs == [1000, 999] and c.data_ptr() != ptr


def test_budget_evicts_cache_then_refuses_without_changing_state():
    raw = CountingBackend()
    arena = HostArena(raw, budget="3kB")
    a, b = arena.empty(1000), arena.empty(1000)
    arena.release(a)
    c = arena.empty(2000)  # needs the cached 1000 B evicted
    assert raw.frees == [1000] and arena.stats().in_use == 3000 and arena.stats().cached == 0
    before = arena.stats()
    with pytest.raises(HostMemoryBudgetError, match=r"does not fit the host-memory budget: 3\.0 kB of 3\.0 kB is in use"):
        arena.empty(1)
    assert arena.stats() == before and raw.allocs == [1000, 1000, 2000]
    arena.release(b)
    arena.release(c)
    assert arena.trim() == 3000 and arena.stats().cached == 0


def test_free_gives_the_buffer_back_to_the_backend_not_to_the_cache():
    raw = CountingBackend()
    arena = HostArena(raw)
    a = arena.empty(1000)
    arena.free(a)
    assert raw.frees == [1000] and (arena.stats().in_use, arena.stats().cached) == (0, 0)
    arena.empty(1000)  # nothing cached to reuse: a new allocation
    assert raw.allocs == [1000, 1000] and arena.stats().reuses == 0
    with pytest.raises(ValueError, match="already released"):
        arena.free(a)


def test_release_of_foreign_or_twice_released_tensor_is_an_error():
    arena = HostArena(CountingBackend())
    with pytest.raises(ValueError, match="did not hand out"):
        arena.release(torch.empty(10))
    t = arena.empty(10)
    arena.release(t)
    with pytest.raises(ValueError, match="already released"):
        arena.release(t)


def test_zero_bytes_and_peak():
    arena = HostArena(CountingBackend(), budget=100)
    assert arena.empty(0).numel() == 0
    x = arena.empty(60)
    arena.release(x)
    arena.empty(40)
    assert arena.stats().peak == 100
