"""backends/cuda.py's topology, the part that needs no GPU: device pairs NVML says nothing about."""
from __future__ import annotations

import torch

from backends.cuda import _peer_links_nvml_missed
from xpu.topology import HOST, Link


def test_a_peer_pair_nvml_missed_gets_a_link_priced_at_the_slower_host_link(monkeypatch):
    # three devices: 0-1 reachable and known to NVML (nvlink), 1-2 reachable but unknown, 0-2 not reachable
    reachable = {(0, 1), (1, 2)}
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (min(i, j), max(i, j)) in reachable)
    links = [Link(HOST, 0, "pcie", 55.0), Link(HOST, 1, "pcie", 50.0), Link(HOST, 2, "pcie", 60.0),
             Link(0, 1, "nvlink", 450.0)]
    added = _peer_links_nvml_missed(3, links)
    assert [(l.src, l.dst, l.kind, l.GBps) for l in added] == [(1, 2, "peer", 50.0)]
    assert "NVML reported no link" in added[0].detail


def test_nothing_is_added_where_the_runtime_cannot_reach_peers(monkeypatch):
    def no_cuda(i, j):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", no_cuda)
    assert _peer_links_nvml_missed(2, [Link(HOST, 0, "pcie", 55.0), Link(HOST, 1, "pcie", 55.0)]) == []
