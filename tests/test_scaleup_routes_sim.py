"""Path discovery, fair sharing, the splitting policy and the path simulator (no devices needed)."""
from __future__ import annotations

import pytest

from scaleup import SplitPolicy, discover_routes, expected_aggregate_GBps, max_min_rates, resource_capacities, shared_resources
from scaleup.routes import apply_probe
from scaleup.simulator import Change, Fail, PathSimulator
from xpu.topology import HOST, DeviceSpec, Link, Topology, preset

MB = 2**20


def test_routes_on_a_dgx_node_direct_first_then_each_peer():
    topo = preset("dgx-h200", 4)
    routes = discover_routes(topo, 2)
    assert [r.name for r in routes] == ["host->2", "host->0->2", "host->1->2", "host->3->2"]
    relay = routes[1]
    assert relay.via == 0 and [h.GBps for h in relay.hops] == [55.0, 450.0] and relay.GBps == 55.0
    assert routes[0].via is None and routes[0].GBps == 55.0


def test_routes_sharing_a_hop_know_it():
    # Devices 1 and 2 sit behind one PCIe switch uplink; every host hop reads host memory.
    devices = tuple(DeviceSpec(i, "d", 10**9) for i in range(3))
    links = (Link(HOST, 0, "pcie", 50.0), Link(HOST, 1, "pcie", 50.0, shared="sw0"), Link(HOST, 2, "pcie", 50.0, shared="sw0"),
             Link(0, 1, "nvlink", 300.0), Link(0, 2, "nvlink", 300.0))
    topo = Topology(devices, links, host_mem_GBps=120.0, extra={"shared_GBps": {"sw0": 64.0}})
    routes = discover_routes(topo, 0)
    shared = shared_resources(routes)
    assert shared["shared:sw0:h2d"] == ["host->1->0", "host->2->0"]
    assert shared["host-mem"] == ["host->0", "host->1->0", "host->2->0"]
    caps = resource_capacities(topo)
    assert caps["shared:sw0:h2d"] == 64.0 and caps["host-mem"] == 120.0
    total, per = expected_aggregate_GBps(routes, caps)
    # The two relays split the 64 GB/s switch; host memory (120) caps the sum of 50 + 64.
    assert total == pytest.approx(114.0) and per["host->1->0"] == pytest.approx(32.0)


def test_nvswitch_ports_are_shared_and_peer_filter_applies():
    topo = preset("dgx-h100", 8)
    routes = discover_routes(topo, 0)
    assert len(routes) == 8 and shared_resources(routes)["port:0:in"] == [r.name for r in routes[1:]]

    class NoPeers:
        def can_access_peer(self, a, b):
            return a == 1

    assert [r.name for r in discover_routes(topo, 0, backend=NoPeers())] == ["host->0", "host->1->0"]
    with pytest.raises(ValueError, match="not a device"):
        discover_routes(topo, 8)


def test_probe_figures_replace_nominal_rates():
    routes = apply_probe(discover_routes(preset("dgx-h200", 2), 0), {"h2d_pinned_GBps": 53.1, "peer_GBps": {"1->0": 390.0}})
    assert [h.GBps for h in routes[1].hops] == [53.1, 390.0] and routes[0].GBps == 53.1


def test_max_min_is_fair_and_respects_limits():
    rates = max_min_rates([("a",), ("a", "b"), ("b",)], {"a": 10.0, "b": 4.0}, limits=[100, 100, 1.0])
    assert rates == pytest.approx([7.0, 3.0, 1.0])
    assert max_min_rates([("unknown",)], {}) == [float("inf")]


def test_policy_learns_and_drops():
    p = SplitPolicy({"a": 10.0, "b": 10.0}, smoothing=0.5)
    p.observe("b", 10**9, 1.0)  # b measured at 1 GB/s
    p.observe("b", 10**9, 1.0)
    assert p.estimate("b") == pytest.approx(3.25) and p.shares()["a"] > 0.7
    # Early in a transfer both routes may take chunks; at the tail only the fast one.
    assert p.pick(["b"], {"a": 0, "b": 0}, remaining=100 * MB, chunk=MB) == "b"
    assert p.pick(["b"], {"a": MB, "b": 0}, remaining=MB, chunk=MB) is None
    p.drop("a", "failed")
    assert p.live == ["b"] and p.shares() == {"b": 1.0} and p.dropped == {"a": "failed"}
    p.revive("a")
    assert p.estimate("a") == 10.0
    with pytest.raises(ValueError, match="positive"):
        SplitPolicy({"a": 0.0})
    with pytest.raises(ValueError, match="smoothing"):
        SplitPolicy({"a": 1.0}, smoothing=0)


@pytest.mark.parametrize("name, n, expected", [
    ("dgx-h200", 1, 55.0), ("dgx-h200", 2, 110.0), ("dgx-h200", 4, 220.0), ("dgx-h200", 8, 400.0),
    ("cloudmatrix384", 2, 320.0), ("cloudmatrix384", 8, 640.0),
])
def test_simulator_reaches_the_steady_state_bound(name, n, expected):
    topo = preset(name, n)
    routes, caps = discover_routes(topo, 0), resource_capacities(topo)
    res = PathSimulator(routes, caps, chunk_bytes=16 * MB).run(4 * 2**30)
    assert expected_aggregate_GBps(routes, caps)[0] == pytest.approx(expected)
    assert 0.95 * expected <= res.GBps <= expected * 1.0001
    assert sum(res.bytes_per_route.values()) == 4 * 2**30


def test_simulator_converges_from_a_wrong_prior():
    topo = preset("dgx-h200", 4)
    routes, caps = discover_routes(topo, 0), resource_capacities(topo)
    caps["link:host->3"] = 11.0  # the truth: host link of device 3 runs at a fifth
    prior = {r.name: 55.0 for r in routes}
    res = PathSimulator(routes, caps, chunk_bytes=8 * MB, prior_GBps=prior).run(2 * 2**30)
    samples = [o for _, o in res.history if o.route == "host->3->0"]
    assert samples[3].estimate_GBps < 0.3 * 55.0  # within four of its chunks
    assert res.chunks_per_route["host->3->0"] < 0.35 * res.chunks_per_route["host->0"]
    assert res.GBps > 0.93 * (3 * 55.0 + 11.0)


def test_simulator_route_slowed_mid_transfer_loses_share_quickly():
    topo = preset("dgx-h200", 4)
    routes, caps = discover_routes(topo, 0), resource_capacities(topo)
    res = PathSimulator(routes, caps, chunk_bytes=8 * MB).run(4 * 2**30, events=[Change(0.005, "link:host->1", 5.0)])
    after = [o for t, o in res.history if o.route == "host->1->0" and t > 0.005]
    assert after[2].share < 0.1 < after[0].share
    late = [o for t, o in res.history if t > 0.01]
    assert sum(o.route == "host->1->0" for o in late) < 0.15 * sum(o.route == "host->0" for o in late)


def test_simulator_failure_resends_and_delivers_everything():
    topo = preset("dgx-h200", 4)
    routes, caps = discover_routes(topo, 0), resource_capacities(topo)
    res = PathSimulator(routes, caps, chunk_bytes=8 * MB).run(2 * 2**30, events=[Fail(0.003, "host->2->0")])
    assert "host->2->0" in res.dropped
    assert sum(res.bytes_per_route.values()) == 2 * 2**30
    with pytest.raises(RuntimeError, match="every route failed"):
        PathSimulator(routes[:1], caps, chunk_bytes=8 * MB).run(2**30, events=[Fail(0.001, "host->0")])
