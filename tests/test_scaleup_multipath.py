"""The adaptive multi-path copier on the cpu backend's virtual devices.

Slow, failing and hanging routes are made through the documented injection point: each
hop's link model (``Route.with_models``), wrapped with ThrottledLink / FailingLink / StalledLink.
"""
from __future__ import annotations

import random

import pytest
import torch

from scaleup import (BackendLink, FailingLink, MultiPathCopier, StalledLink, ThrottledLink, TransferError,
                     discover_routes)
from tests.stream_recording import StreamCheck

KB = 1024


def _routes(backend, wrap=None, rate=None):
    routes = discover_routes(backend.topology(), 0, backend=backend)
    if rate is not None:  # the prior the policy starts from (as xpu probe would give)
        routes = [r.with_rates([rate] * len(r.hops)) for r in routes]
    if wrap is not None:
        routes = [r.with_models(lambda hop, model, r=r: wrap(r, hop, BackendLink(backend))) for r in routes]
    return routes


def _bytes_equal(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_routes_of_the_cpu_backend(cpu_backend):
    names = [r.name for r in discover_routes(cpu_backend.topology(), 0, backend=cpu_backend)]
    assert names == ["host->0", "host->1->0", "host->2->0", "host->3->0"]


def test_round_trips_over_random_route_mixes_sizes_and_dtypes(cpu_backend):
    rnd = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    all_routes = _routes(cpu_backend)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64, torch.int16]
    for trial in range(8):
        mix = rnd.sample(all_routes, rnd.randint(1, len(all_routes)))
        chunk = rnd.choice([1000, 4 * KB + 3, 64 * KB])
        copier = MultiPathCopier(cpu_backend, 0, routes=mix, chunk_bytes=chunk, probe=None)
        group = []
        for _ in range(rnd.randint(1, 4)):
            dtype = rnd.choice(dtypes)
            numel = rnd.choice([0, 1, 7, 5001, rnd.randint(0, 60000)])
            raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
            t = (raw & 1 if dtype == torch.bool else raw).view(dtype)
            if rnd.random() < 0.5:
                p = cpu_backend.host_arena.empty(t.shape, t.dtype)
                p.copy_(t)
                t = p
            group.append(t)
        transfer = copier.h2d(group)
        out = transfer.synchronize()
        assert all(_bytes_equal(a, b) for a, b in zip(out, group))
        assert sum(transfer.stats["bytes_per_route"].values()) == transfer.nbytes
        assert set(transfer.stats["bytes_per_route"]) == {r.name for r in mix}
        copier.close()


def test_every_route_carries_bytes_when_links_are_equal(cpu_backend):
    routes = _routes(cpu_backend, wrap=lambda r, hop, m: ThrottledLink(m, 0.1), rate=0.1)
    copier = MultiPathCopier(cpu_backend, 0, routes=routes, chunk_bytes=128 * KB, probe=None)
    src = cpu_backend.host_arena.empty(4 << 20)
    src.random_(0, 255)
    t = copier.h2d(src)
    assert torch.equal(t.synchronize(), src)
    assert all(n > 0 for n in t.stats["chunks_per_route"].values()), t.stats["chunks_per_route"]


def test_a_slow_route_loses_share(cpu_backend):
    # Every hop runs at 0.1 GB/s except both hops via device 2 at 0.02; the policy starts equal.
    def wrap(route, hop, model):
        return ThrottledLink(model, 0.02 if route.via == 2 else 0.1)

    copier = MultiPathCopier(cpu_backend, 0, routes=_routes(cpu_backend, wrap, rate=0.1), chunk_bytes=128 * KB, probe=None)
    src = torch.randint(0, 255, (6 << 20,), dtype=torch.uint8)
    t = copier.h2d(src)
    assert torch.equal(t.synchronize(), src)
    shares, chunks = t.stats["shares"], t.stats["chunks_per_route"]
    slow, fast = "host->2->0", ["host->0", "host->1->0", "host->3->0"]
    assert shares[slow] < 0.6 * min(shares[f] for f in fast), shares
    assert chunks[slow] < 0.6 * min(chunks[f] for f in fast), chunks


def test_a_route_slowed_mid_transfer_loses_share_within_a_few_chunks(cpu_backend):
    chunk = 128 * KB

    def wrap(route, hop, model):
        if route.via is None:  # the direct link drops to a tenth after 6 chunks
            return ThrottledLink(model, 0.1, slow_after_bytes=6 * chunk, slow_GBps=0.01)
        return ThrottledLink(model, 0.1)

    copier = MultiPathCopier(cpu_backend, 0, routes=_routes(cpu_backend, wrap, rate=0.1), chunk_bytes=chunk, probe=None)
    src = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8)
    t = copier.h2d(src)
    assert torch.equal(t.synchronize(), src)
    direct = [o for o in t.stats["history"] if o.route == "host->0"]
    assert len(direct) >= 8
    before = direct[5].share
    slowed = [o for o in direct[6:] if o.sample_GBps < 0.03]
    assert slowed, [round(o.sample_GBps, 3) for o in direct]
    # By the third slow chunk its share has fallen below half of what it was.
    third = direct[direct.index(slowed[0]) + 2] if len(slowed) >= 3 else direct[-1]
    assert third.share < before / 2, [(round(o.sample_GBps, 3), round(o.share, 3)) for o in direct]


def test_a_route_failing_mid_transfer_is_dropped_and_data_arrives_whole(cpu_backend):
    chunk = 64 * KB
    links = {}

    def wrap(route, hop, model):
        if route.via == 1 and hop.src == 1:  # relay 1's peer hop dies after 3 chunks
            links["bad"] = FailingLink(model, fail_after_bytes=3 * chunk)
            return links["bad"]
        return model

    copier = MultiPathCopier(cpu_backend, 0, routes=_routes(cpu_backend, wrap), chunk_bytes=chunk, probe=None)
    group = [torch.randn(300_001), torch.randint(0, 255, (777_777,), dtype=torch.uint8)]
    t = copier.h2d(group)
    out = t.synchronize()
    assert all(_bytes_equal(a, b) for a, b in zip(out, group))
    assert "host->1->0" in t.stats["dropped"] and "injected link failure" in t.stats["dropped"]["host->1->0"]
    assert links["bad"].failures >= 1
    assert t.stats["bytes_per_route"]["host->1->0"] <= 3 * chunk
    assert sum(t.stats["bytes_per_route"].values()) == t.nbytes
    assert "host->1->0" not in copier.policy.shares()
    # The next transfer goes around the dropped route from the start.
    t2 = copier.h2d(group[0])
    assert _bytes_equal(t2.synchronize(), group[0]) and t2.stats["bytes_per_route"]["host->1->0"] == 0


def test_a_stalled_route_is_dropped_after_the_timeout(cpu_backend):
    chunk = 64 * KB
    stalls = {}

    def wrap(route, hop, model):
        if route.via is None:
            stalls["direct"] = StalledLink(model, stall_after_bytes=2 * chunk)
            return stalls["direct"]
        return ThrottledLink(model, 0.2)

    copier = MultiPathCopier(cpu_backend, 0, routes=_routes(cpu_backend, wrap), chunk_bytes=chunk, probe=None,
                             stall_timeout_s=0.3, stall_factor=1.0)
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    try:
        t = copier.h2d(src)
        assert torch.equal(t.synchronize(timeout=30), src)
        assert stalls["direct"].stalled.is_set()
        assert t.stats["dropped"]["host->0"].startswith("stalled")
    finally:
        stalls["direct"].release()


def test_when_every_route_fails_the_transfer_says_why(cpu_backend):
    routes = _routes(cpu_backend, wrap=lambda r, hop, m: FailingLink(m, 0))
    copier = MultiPathCopier(cpu_backend, 0, routes=routes, chunk_bytes=4 * KB, probe=None)
    t = copier.h2d(torch.zeros(10_000))
    with pytest.raises(TransferError, match=r"every route to device 0 failed.*host->0: copy failed"):
        t.synchronize(timeout=30)


def test_peer_pools_never_exceed_their_bound(cpu_backend):
    chunk = 32 * KB
    budget = 3 * chunk + 100  # room for 3 whole chunks per peer
    peers = [1, 2, 3]
    base = {p: cpu_backend.memory_stats(p).allocated for p in peers}
    for p in peers:
        cpu_backend.reset_peak_memory(p)
    routes = _routes(cpu_backend, wrap=lambda r, hop, m: ThrottledLink(m, 0.5))
    copier = MultiPathCopier(cpu_backend, 0, routes=routes, chunk_bytes=chunk, window=8, peer_memory=budget, probe=None)
    src = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)
    t = copier.h2d(src)
    assert torch.equal(t.synchronize(), src)
    for p in peers:
        pool = copier.pools[p]
        assert pool.bound_bytes == 3 * chunk and pool.max_slots == 3
        assert pool.high_water_bytes <= budget and pool.peak_in_use <= 3
        assert cpu_backend.memory_stats(p).peak_allocated - base[p] <= budget
        assert t.stats["pool_high_water"][p] <= t.stats["pool_bound"][p]
    copier.close()


def test_pageable_sources_use_bounded_host_staging(cpu_backend):
    chunk = 16 * KB
    copier = MultiPathCopier(cpu_backend, 0, chunk_bytes=chunk, host_staging=2 * chunk, probe=None)
    src = torch.randn(100_000)
    assert _bytes_equal(copier.h2d(src).synchronize(), src)
    assert copier.host_pool.high_water_bytes <= 2 * chunk
    copier.close()


def test_initial_shares_come_from_probe_figures(cpu_backend):
    probe = {"h2d_pinned_GBps": 20.0, "peer_GBps": {"1->0": 5.0, "2->0": 80.0, "3->0": 80.0}}
    copier = MultiPathCopier(cpu_backend, 0, probe=probe)
    est = copier.policy.estimates()
    assert est == {"host->0": 20.0, "host->1->0": 5.0, "host->2->0": 20.0, "host->3->0": 20.0}
    assert copier.policy.shares()["host->1->0"] == pytest.approx(5 / 65)


def test_bad_settings_are_refused(cpu_backend):
    with pytest.raises(ValueError, match="less than one chunk"):
        MultiPathCopier(cpu_backend, 0, chunk_bytes=1 << 20, peer_memory=1000)
    with pytest.raises(ValueError, match="window"):
        MultiPathCopier(cpu_backend, 0, window=0)
    other = discover_routes(cpu_backend.topology(), 1, backend=cpu_backend)
    with pytest.raises(ValueError, match="not to target 0"):
        MultiPathCopier(cpu_backend, 0, routes=other)
    copier = MultiPathCopier(cpu_backend, 0, probe=None)
    with pytest.raises(ValueError, match="not contiguous"):
        copier.h2d(torch.randn(4, 4).t())
    with pytest.raises(ValueError, match="must match"):
        copier.h2d(torch.zeros(4), out=cpu_backend.empty(5, torch.float32, 0))


def test_without_peer_access_only_the_direct_route_is_used(monkeypatch):
    import xpu

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    monkeypatch.setenv("XPU_CPU_PEER_GBPS", "0")
    xpu.reset_backend()
    b = xpu.get_backend()
    try:
        assert not b.caps.peer_access
        copier = MultiPathCopier(b, 2, probe=None)
        assert [r.name for r in copier.routes] == ["host->2"]
        x = torch.randn(1000)
        assert torch.equal(copier.h2d(x).synchronize(), x)
    finally:
        xpu.reset_backend()


def test_route_threads_bind_the_target_device_first(cpu_backend, monkeypatch):
    """Each route's thread makes the copier's target its current device before it issues
    copies: a new thread starts on device 0 (on CUDA, a context there in every process)."""
    import threading

    bound = []
    real = cpu_backend.bind_process
    monkeypatch.setattr(cpu_backend, "bind_process",
                        lambda index: bound.append((threading.current_thread().name, index)) or real(index))
    copier = MultiPathCopier(cpu_backend, 1, chunk_bytes=128 * KB, probe=None)
    src = cpu_backend.host_arena.empty(1 << 20)
    src.random_(0, 255)
    assert torch.equal(copier.h2d(src).synchronize(), src)
    names = {name for name, index in bound if index == 1}
    assert {f"scaleup-{r.name}" for r in copier.routes} <= names, bound
    copier.close()


def test_relayed_chunks_keep_the_stream_contract(cpu_backend):
    """A relay's staging buffers come from the peer's pool, whose earlier kernels may still use
    that memory: the route's copies start after them (they did not wait for the peer), and every
    copy is ordered as a device would need (``tests/stream_recording.py``)."""
    with StreamCheck(cpu_backend) as check:
        relay = [r for r in discover_routes(check.topology(), 0, backend=check) if r.via is not None][:1]
        copier = MultiPathCopier(check, 0, routes=relay, chunk_bytes=KB, probe=None)
        src = [check.host_arena.empty(5000), torch.randint(0, 256, (3000,), dtype=torch.uint8)]
        src[0].fill_(7)
        out = copier.h2d(src).synchronize()
        copier.close()
    assert check.breaches == []
    assert all(_bytes_equal(a, b) for a, b in zip(out, src))
