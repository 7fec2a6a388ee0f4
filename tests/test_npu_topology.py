"""The NPU backend's topology (backends/npu_topology.py): the npu-smi parser on sampled outputs of
910B, PCIe and A3 machines, and the backend's topology and NUMA placement through the recording
stand-in torch_npu (tests/fake_torch_npu.py). Nothing here touches an NPU."""
from __future__ import annotations

import pytest

import backends.npu_topology as topo_mod
from backends.npu import NpuBackend
from backends.npu_topology import npu_smi_peer_links, numa_node_of_cpus, parse_npu_smi_topo, soc_rates
from fake_torch_npu import SAMPLE_910B_TOPO, SAMPLE_A3_TOPO, SAMPLE_PCIE_TOPO
from tests.test_npu_backend import GiB, backend, clean_env, fake, install  # noqa: F401  (fixtures)
from xpu.topology import HOST, Topology


# ---------------------------------------------------------------------------- topology
def test_parse_910b_sample():
    topo = parse_npu_smi_topo(SAMPLE_910B_TOPO, None)
    assert topo.labels == tuple(f"NPU{i}" for i in range(8))
    assert topo.rows == tuple(range(8))
    assert all(topo.relation(a, b) == ("X" if a == b else "HCCS") for a in range(8) for b in range(8))
    assert topo.cpu_affinity == ("144-167", "144-167", "96-119", "96-119", "0-23", "0-23", "48-71", "48-71")


def test_topology_910b_full_mesh(backend, fake, monkeypatch):  # noqa: F811
    numa = {6: set(range(144, 168)), 4: set(range(96, 120)), 0: set(range(0, 24)), 2: set(range(48, 72))}
    monkeypatch.setattr(topo_mod, "_host_numa_cpus", lambda: numa)
    topo = backend.topology()
    assert [d.numa_node for d in topo.devices] == [6, 6, 4, 4, 0, 0, 2, 2]  # from the CPU Affinity column
    assert topo.source == "npu-smi"
    assert [(d.index, d.name, d.total_bytes) for d in topo.devices] == [(i, "Ascend910B3", 64 * GiB) for i in range(8)]
    host = [l for l in topo.links if l.is_host_link]
    peer = [l for l in topo.links if not l.is_host_link]
    assert [(l.src, l.dst, l.kind, l.GBps) for l in host] == [(HOST, i, "pcie", 63.0) for i in range(8)]
    assert len(peer) == 28 and {(l.kind, l.GBps) for l in peer} == {("hccs", 56.0)}
    assert all("nominal, vendor-reported, not measured" in l.detail for l in topo.links)
    assert topo.peers(0) == list(range(1, 8))
    assert topo.extra["npu_smi"]["cpu_affinity"][2] == "96-119"
    assert Topology.from_json(topo.to_json()) == topo
    assert backend.topology() is topo  # computed once


def test_topology_remaps_visible_devices(install, monkeypatch):  # noqa: F811
    install(device_count=2)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    topo = NpuBackend().topology()
    assert topo.extra["npu_smi"]["labels"] == ["NPU2", "NPU3"]
    assert topo.extra["npu_smi"]["cpu_affinity"] == ["96-119", "96-119"]
    assert [(l.src, l.dst, l.kind) for l in topo.links if not l.is_host_link] == [(0, 1, "hccs")]


def test_pcie_sample_links_and_remap():
    topo = parse_npu_smi_topo(SAMPLE_PCIE_TOPO, None)
    links = npu_smi_peer_links(topo, "Ascend910B4")
    # PIX gives a PCIe peer link; PHB (through the CPU) and SYS (across sockets) give none
    assert [(l.src, l.dst, l.kind, l.GBps) for l in links] == [(0, 1, "pcie", 63.0)]
    assert "npu-smi PIX" in links[0].detail
    remapped = parse_npu_smi_topo(SAMPLE_PCIE_TOPO, [2, 3])
    assert remapped.labels == ("NPU2", "NPU3") and remapped.relation(0, 1) == "PHB"
    assert remapped.cpu_affinity == ("32-63", "32-63")
    assert npu_smi_peer_links(remapped, "Ascend910B4") == []
    assert parse_npu_smi_topo(SAMPLE_PCIE_TOPO, [1, 2]).relation(1, 0) == "SYS"


def test_pcie_topology_through_backend(install, monkeypatch):  # noqa: F811
    install(topo_text=SAMPLE_PCIE_TOPO, device_count=2)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    topo = NpuBackend().topology()
    assert topo.peer_link(0, 1).kind == "pcie"


def test_a3_sample_with_phy_ids_and_sio():
    topo = parse_npu_smi_topo(SAMPLE_A3_TOPO, None)
    assert topo.labels == ("Phy-ID12", "Phy-ID13") and topo.relation(0, 1) == "SIO"
    assert topo.cpu_affinity == (None, None)
    links = npu_smi_peer_links(topo, "Ascend910_9392")
    assert [(l.src, l.dst, l.kind, l.GBps) for l in links] == [(0, 1, "sio", 196.0)]
    assert "placeholder" in links[0].detail
    assert soc_rates("Ascend910_9392").host[:2] == ("ub", 160.0)


def test_unknown_soc_gets_marked_placeholders():
    rates = soc_rates("Ascend950PR")
    assert rates.host[:2] == ("pcie", 31.5) and "assumed" in rates.host[2]
    assert "assumed" in rates.peer["HCCS"][2]


def test_parser_rejects_bad_input():
    with pytest.raises(ValueError, match="no device matrix"):
        parse_npu_smi_topo("npu-smi: command not supported on this product\n", None)
    with pytest.raises(ValueError, match="lists 8 device"):
        parse_npu_smi_topo(SAMPLE_910B_TOPO, [7, 8])
    truncated = SAMPLE_910B_TOPO.replace("NPU3       HCCS       HCCS       HCCS       X", "NPU3       HCCS")
    with pytest.raises(ValueError, match="has 5 entries for 8 devices"):
        parse_npu_smi_topo(truncated, None)


def test_topology_without_npu_smi(install, monkeypatch):  # noqa: F811
    install()

    def missing(timeout=10.0):
        raise FileNotFoundError(2, "No such file or directory", "npu-smi")

    monkeypatch.setattr(topo_mod, "_run_npu_smi_topo", missing)
    topo = NpuBackend().topology()
    assert topo.source.startswith("torch_npu (npu-smi unavailable: FileNotFoundError")
    assert topo.device_count == 8 and all(l.is_host_link for l in topo.links) and len(topo.links) == 8


def test_topology_ignores_npu_smi_that_disagrees_with_torch_npu(install):  # noqa: F811
    install(device_count=4)  # npu-smi lists 8, ASCEND_RT_VISIBLE_DEVICES unset
    topo = NpuBackend().topology()
    assert "npu-smi maps to 8 device(s) but torch_npu sees 4" in topo.source
    assert topo.device_count == 4


def test_npu_smi_runner(monkeypatch):
    seen = []

    class Proc:
        def __init__(self, rc, out, err):
            self.returncode, self.stdout, self.stderr = rc, out, err

    def run(cmd, **kwargs):
        seen.append((cmd, kwargs))
        return Proc(0, SAMPLE_A3_TOPO, "") if len(seen) == 1 else Proc(255, "", "This device does not support querying topo.\n")

    monkeypatch.setattr(topo_mod.subprocess, "run", run)
    assert topo_mod._run_npu_smi_topo() == SAMPLE_A3_TOPO
    assert seen[0][0] == ["npu-smi", "info", "-t", "topo"] and seen[0][1]["timeout"] > 0
    with pytest.raises(RuntimeError, match="status 255: This device does not support"):
        topo_mod._run_npu_smi_topo()


def test_numa_node_of_cpus():
    nodes = {0: set(range(0, 48)), 1: set(range(48, 96))}
    assert numa_node_of_cpus("0-23", nodes) == 0
    assert numa_node_of_cpus("48-71,90", nodes) == 1
    assert numa_node_of_cpus("40-60", nodes) is None
    assert numa_node_of_cpus(None, nodes) is None
