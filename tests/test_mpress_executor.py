"""MPress swap executor and planner, in one process on the cpu backend's virtual devices."""
from __future__ import annotations

import pytest
import torch

from strategies.models import build_model
from strategies.mpress import Decision, StageExecutor, split_model
from strategies.mpress.ipc import RegionAllocator, export_buffer, import_buffer, unlink_buffer
from strategies.mpress.memory_profile import BlockProfile, StageProfile
from strategies.mpress.planner import InfeasibleBudgetError, format_plan, plan_offload
from strategies.mpress.stages import lm_loss, partition_blocks
from tests.stream_recording import StreamCheck

DIMS = dict(layers=3, hidden=32, heads=2, vocab=64, seq=32)


def _reference(batch=4):
    torch.manual_seed(0)
    model = build_model("gpt", **DIMS)
    idx = torch.randint(64, (batch, 32), generator=torch.Generator().manual_seed(1))
    loss = model(idx, idx.roll(1, 1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, idx


def _stage_on_device(backend, device=0):
    torch.manual_seed(0)
    model = build_model("gpt", **DIMS)
    stage = split_model(model, 1)[0]
    with backend.device_scope(device):
        for p in stage.parameters():
            p.data = backend.to_device(p.data, device)
    return stage


def _run(backend, decisions, peer_regions=None):
    """Forward on device 0; returns (loss, grads, executor, device-0 bytes held between forward and backward)."""
    loss_ref, grads_ref, idx = _reference()
    stage = _stage_on_device(backend)
    ex = StageExecutor(backend, 0, decisions, params=list(stage.parameters()), peer_regions=peer_regions)
    stage.executor = ex
    with backend.device_scope(0):
        loss = lm_loss(stage(idx), idx.roll(1, 1))
        held = backend.memory_stats(0).allocated
        loss.backward()
    grads = {n: p.grad for n, p in stage.named_parameters()}
    for n, g in grads.items():
        torch.testing.assert_close(g, grads_ref[n], atol=1e-6, rtol=0)
    assert abs(loss.item() - loss_ref) < 1e-6
    return ex, held


def test_each_decision_moves_bytes_where_it_says_and_gradients_match(cpu_backend):
    b = cpu_backend
    ex_keep, held_keep = _run(b, {})
    assert ex_keep.stats.bytes["keep"] > 0 and not ex_keep.stats.bytes.get("host")

    ex_host, held_host = _run(b, {0: "host", 1: "host", 2: "host"})
    assert ex_host.stats.bytes["host"] > 0, "host swap was not taken"
    assert ex_host.stats.swapped_in == ex_host.stats.bytes["host"]
    # Measured, not predicted: the device holds less between forward and backward.
    assert held_host < held_keep - ex_host.stats.bytes["host"] // 2

    ex_rec, held_rec = _run(b, {0: "recompute", 1: "recompute", 2: "recompute"})
    assert ex_rec.stats.recompute_forwards == 3 and ex_rec.stats.recompute_reruns == 3, "recompute was not taken"
    assert held_rec < held_keep

    pool, handle = export_buffer(b, 4 << 20, 1)
    try:
        region = import_buffer(b, handle)
        before1 = b.memory_stats(1).allocated
        with StreamCheck(b) as check:  # swap copies ordered and kept alive as a device needs
            ex_peer, held_peer = _run(check, {0: "peer:1", 1: "peer:1", 2: "host"}, {1: region})
        assert check.breaches == []
        assert ex_peer.stats.bytes["peer:1"] > 0, "peer swap was not taken"
        assert ex_peer.stats.bytes["host"] > 0 and ex_peer.stats.fallbacks == 0
        assert ex_peer.region_peak(1) >= ex_peer.stats.bytes["peer:1"]
        assert held_peer < held_keep - ex_peer.stats.bytes["peer:1"] // 2
        # The pool counts against the peer's budget (allocated at export), not device 0's.
        assert before1 >= 4 << 20 and b.memory_stats(1).allocated == before1
    finally:
        unlink_buffer(b, handle)


def test_full_peer_region_falls_back_to_host_and_says_so(cpu_backend):
    pool, handle = export_buffer(cpu_backend, 4096, 1)
    unlink_buffer(cpu_backend, handle)
    ex, _ = _run(cpu_backend, {0: "peer:1"}, {1: pool})
    assert ex.stats.fallbacks > 0 and ex.stats.bytes["host"] > 0


def test_bad_decisions_are_refused_before_running(cpu_backend):
    with pytest.raises(ValueError, match="valid"):
        Decision.parse("swap")
    with pytest.raises(ValueError, match="device"):
        Decision.parse("peer:x")
    with pytest.raises(ValueError, match="no region"):
        StageExecutor(cpu_backend, 0, {0: "peer:2"})
    with pytest.raises(ValueError, match="own device"):
        StageExecutor(cpu_backend, 0, {0: "peer:0"}, peer_regions={0: torch.empty(64, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="cannot fill"):
        partition_blocks(2, 3)


def test_region_allocator_reuses_and_merges():
    a = RegionAllocator(1024)
    x, y = a.alloc(100), a.alloc(100)
    assert (x, y) == (0, 128) and a.alloc(2000) is None
    a.free(x, 100)
    a.free(y, 100)
    assert a.alloc(1024) == 0 and a.peak == 1024


# ---------------------------------------------------------------------------------- planner
def _profiles(stages=3, blocks=2, saved=1000, fwd=1e-3):
    out = []
    for s in range(stages):
        bps = tuple(BlockProfile(s * blocks + i, saved, 4, 100, fwd, 2 * fwd, 5e-3) for i in range(blocks))
        out.append(StageProfile(s, s, bps, peak_bytes=10_000 + (stages - s) * blocks * saved, inflight=stages - s, microbatches=4))
    return out


def _rates(n=3, host=10e9, peer=100e9):
    return {d: host for d in range(n)}, {(a, b): peer for a in range(n) for b in range(n) if a != b}


def test_planner_keeps_everything_when_budgets_fit():
    plan = plan_offload(_profiles(), {0: 10**6, 1: 10**6, 2: 10**6}, host_rate=_rates()[0], peer_rate=_rates()[1])
    assert all(not sp.decisions for sp in plan.stages) and not plan.regions
    assert "kept" in format_plan(plan)


def test_planner_swaps_the_first_stage_to_tail_peers():
    profiles = _profiles()
    host, peer = _rates()
    budget0 = profiles[0].peak_bytes - 2500
    plan = plan_offload(profiles, {0: budget0, 1: 10**6, 2: 10**6}, host_rate=host, peer_rate=peer)
    kinds = {d.kind for d in plan.stages[0].decisions.values()}
    assert kinds == {"peer"}, format_plan(plan)
    assert plan.stages[0].predicted_peak <= budget0
    assert {j for (_, j) in plan.regions} <= {1, 2} and sum(plan.stages[0].to_peer.values()) > 0


def test_planner_uses_host_without_peers_and_recompute_when_cheaper():
    profiles = _profiles()
    host, _ = _rates()
    budget0 = profiles[0].peak_bytes - 2500
    plan = plan_offload(profiles, {0: budget0, 1: 10**6, 2: 10**6}, host_rate=host, peer_rate={}, allow_peer=False)
    assert {d.kind for d in plan.stages[0].decisions.values()} == {"host"}
    slow = {d: 1e3 for d in host}  # a link so slow that recomputing is cheaper
    plan = plan_offload(profiles, {0: budget0, 1: 10**6, 2: 10**6}, host_rate=slow, peer_rate={}, allow_peer=False)
    assert {d.kind for d in plan.stages[0].decisions.values()} == {"recompute"}


def test_planner_respects_peer_spare_memory():
    profiles = _profiles()
    host, peer = _rates()
    tight = {0: profiles[0].peak_bytes - 2500, 1: profiles[1].peak_bytes + 10, 2: profiles[2].peak_bytes + 10}
    plan = plan_offload(profiles, tight, host_rate=host, peer_rate=peer)
    assert not plan.regions and plan.stages[0].to_host > 0


def test_infeasible_budget_is_refused_with_the_minimum():
    profiles = _profiles()
    host, peer = _rates()
    with pytest.raises(InfeasibleBudgetError, match="needs at least") as info:
        plan_offload(profiles, {0: 5000, 1: 10**6, 2: 10**6}, host_rate=host, peer_rate=peer)
    need = info.value.minimum[0]
    assert need == 10_000 + 2 * 1000  # static bytes plus the transient headroom of two blocks
    plan = plan_offload(profiles, {0: need, 1: 10**6, 2: 10**6}, host_rate=host, peer_rate=peer)
    assert plan.stages[0].predicted_peak <= need
    with pytest.raises(ValueError, match="no budget"):
        plan_offload(profiles, {0: need}, host_rate=host, peer_rate=peer)


def test_stages_sharing_a_device_share_its_budget_and_never_swap_to_each_other():
    from dataclasses import replace

    host, _ = _rates()
    peer = {(a, b): 100e9 for a in range(2) for b in range(2)}  # even a "link" from device 0 to itself
    two = [replace(p, device=0) for p in _profiles(stages=2)]
    budget = sum(p.peak_bytes for p in two) - 1000  # fits either stage alone, not both
    assert max(p.peak_bytes for p in two) < budget
    plan = plan_offload(two, {0: budget}, host_rate=host, peer_rate=peer)
    assert plan.device_peaks()[0] == sum(sp.predicted_peak for sp in plan.stages) <= budget, format_plan(plan)
    assert {d.kind for sp in plan.stages for d in sp.decisions.values()} <= {"host", "recompute"}, format_plan(plan)
    assert "device 0 (stages 0, 1, one budget): predicted" in format_plan(plan)
    # One device each, the same budget: both fit as they are.
    apart = plan_offload(_profiles(stages=2), {0: budget, 1: budget}, host_rate=host, peer_rate=peer)
    assert all(not sp.decisions for sp in apart.stages)
    # A third stage on another device takes the swaps; its pool counts against its own device.
    three = two + [replace(_profiles(stages=3)[2], device=1)]
    plan = plan_offload(three, {0: budget, 1: 10**6}, host_rate=host, peer_rate=peer)
    assert {str(d) for sp in plan.stages[:2] for d in sp.decisions.values()} == {"peer:2"}, format_plan(plan)
    assert {j for (_, j) in plan.regions} == {2} and plan.device_peaks()[1] > three[2].peak_bytes
    with pytest.raises(InfeasibleBudgetError, match=r"^infeasible memory budget; device 0 \(stages 0, 1\): budget "
                                                    r"5\.0 kB, needs at least") as info:
        plan_offload(two, {0: 5000}, host_rate=host, peer_rate=peer)
    assert info.value.minimum == {0: (10_000 + 2 * 1000) * 2}  # each stage's static bytes plus its transient
