"""The transfer benchmarks and predictions of :mod:`bench.transfers`, on the cpu backend.

The multi-path benchmark (``python -m bench.transfers.multipath``) runs on the cpu backend's 4
virtual devices. The cpu backend's figures are meaningless as speeds (its copies are
synchronous memcpys on a shared host); what is checked here is that every configuration is
measured, relays carry bytes, predictions sit beside the measurements, and that the byte check
really withholds the number of a copier that delivers wrong data. The engine benchmark and
the prediction script get a smoke run each.
"""
from __future__ import annotations

import json

import pytest
import torch

import bench.transfers.multipath as bm
from bench.transfers import engine as be
from bench.transfers import predict
from bench.transfers.multipath_measure import POISON, auto_chunk, fill_pattern, verify_bytes
from scaleup import BackendLink, TransferEngine

MiB = 2**20
SIZES = [1 * MiB, 4 * MiB]


@pytest.fixture
def cpu_bench(cpu_backend, monkeypatch, tmp_path):
    """The cpu backend, with no cached ``xpu probe`` figures leaking in from this machine."""
    monkeypatch.setenv("XPU_CACHE_DIR", str(tmp_path / "cache"))
    return cpu_backend


def test_main_measures_every_configuration_and_predicts_beside_it(cpu_bench, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bm.main(["--sizes", "1MiB,4MiB", "--targets", "0", "--repeats", "2", "--out", str(out), "--json"])
    assert rc == 0
    files = list(out.glob("scaleup-multipath-cpu-*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert json.loads(capsys.readouterr().out) == result  # --json: stdout is exactly the file

    for key in ("machine", "date", "torch", "command", "topology", "settings"):
        assert result[key], key
    assert result["torch"] == torch.__version__ and "bench.transfers.multipath" in result["command"]
    assert result["ok"] and result["mismatches"] == []

    relays = ["host->1->0", "host->2->0", "host->3->0"]
    assert [(r["target"], r["size_bytes"]) for r in result["rows"]] == [(0, s) for s in SIZES]
    for row in result["rows"]:
        assert row["routes"] == ["host->0"] + relays
        for config in ("direct", "copier_direct", "multipath"):
            assert row[config]["verified"] == {"ok": True}, config
            assert row[config]["GBps"] > 0 and len(row[config]["times_s"]) == 2
        mp = row["multipath"]
        assert sum(mp["bytes_per_route"].values()) == row["size_bytes"]
        assert sum(mp["bytes_per_route_all_repeats"][r] for r in relays) > 0, mp["bytes_per_route_all_repeats"]
        assert set(mp["shares"]) == set(row["routes"]) and sum(mp["shares"].values()) == pytest.approx(1.0, abs=1e-3)
        assert row["speedup"] == pytest.approx(row["direct"]["median_s"] / mp["median_s"], abs=1e-3)
        # Predictions for the same routes: declared 25 GB/s host links, 100 GB/s peer links.
        topo = row["predicted"]["topology"]
        assert set(topo["bytes_per_route"]) == set(row["routes"])
        assert 25 < topo["GBps"] <= 100 and topo["speedup"] > 1
        assert row["predicted"]["measured_links"]["GBps"] > 0

    assert [c["size_bytes"] for c in result["concurrent"]] == SIZES
    for conc in result["concurrent"]:
        assert conc["devices"] == 4 and conc["verified"]["ok"]
        assert conc["aggregate_GBps"] > 0 and conc["per_device_GBps"] == pytest.approx(conc["aggregate_GBps"] / 4, abs=0.01)
        assert conc["predicted"]["topology"]["aggregate_GBps"] == 100  # 4 x 25 GB/s, no host-memory bound declared
    assert set(result["links_measured"]["peer_GBps"]) == {"1->0", "2->0", "3->0"}
    pytest.importorskip("matplotlib")
    assert files[0].with_suffix(".png").exists()


class _CorruptingLink:
    """Copies, then flips the last byte it wrote: a fast-but-wrong link."""

    def __init__(self, inner) -> None:
        self.inner, self.corrupted = inner, 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        self.inner.copy(dst, src, stream)
        dst[-1:].bitwise_not_()
        self.corrupted += 1


def test_a_route_that_corrupts_data_gets_no_number(cpu_bench, monkeypatch, capsys):
    links = []
    real = bm.discover_routes

    def corrupting_routes(topo, target, **kw):
        # Every route's last hop (the one writing into the target) corrupts; the engine's
        # direct copy and the read-back do not go through routes, so they stay honest.
        def wrap(route):
            def model(hop, m):
                m = m or BackendLink(cpu_bench)
                if hop.dst == route.target:
                    links.append(_CorruptingLink(m))
                    return links[-1]
                return m
            return route.with_models(model)
        return [wrap(r) for r in real(topo, target, **kw)]

    monkeypatch.setattr(bm, "discover_routes", corrupting_routes)
    rc = bm.main(["--sizes", "1MiB", "--repeats", "1", "--no-plot"])
    table = capsys.readouterr().out
    assert rc == 1
    assert any(link.corrupted for link in links)
    assert "BYTE MISMATCH" in table
    # The JSON view of the same failure.
    rc = bm.main(["--sizes", "1MiB", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1 and not result["ok"]
    row = result["rows"][0]
    assert row["direct"]["verified"] == {"ok": True} and row["direct"]["GBps"] > 0
    for config in ("copier_direct", "multipath"):
        check = row[config]["verified"]
        assert check["ok"] is False and check["bad_bytes"] >= 1, config
        assert row[config]["GBps"] is None and row[config]["best_GBps"] is None  # no number for wrong bytes
    assert row["speedup"] is None
    assert {m["config"] for m in result["mismatches"]} == {"copier_direct", "multipath"}


def test_the_byte_check_catches_misplaced_foreign_and_missing_bytes(cpu_bench):
    b = cpu_bench
    n = 1 * MiB + 5  # a tail that is not a whole word
    src = fill_pattern(b.host_arena.empty(n), salt=1)
    other = fill_pattern(b.host_arena.empty(n), salt=2)
    scratch = b.host_arena.empty(n)
    dst = b.empty(n, torch.uint8, 0)
    words = src[: n // 8 * 8].view(torch.int64)
    assert torch.unique(words).numel() == words.numel()  # every word says where it belongs
    with TransferEngine(b) as engine:
        dst.copy_(src)
        assert verify_bytes(engine, 0, dst, src, scratch) == {"ok": True}
        half = n // 2 // 8 * 8  # two halves swapped: same bytes, wrong places
        dst[:half].copy_(src[half:2 * half])
        dst[half:2 * half].copy_(src[:half])
        assert not verify_bytes(engine, 0, dst, src, scratch)["ok"]
        dst.copy_(other)  # another device's data
        assert not verify_bytes(engine, 0, dst, src, scratch)["ok"]
        dst.copy_(src)
        dst[-3:].fill_(POISON)  # the tail never written
        check = verify_bytes(engine, 0, dst, src, scratch)
        assert check == {"ok": False, "bad_bytes": 3, "first_bad_offset": n - 3, "expected": 0xA5, "got": POISON}


def test_auto_chunk_gives_every_route_room():
    assert auto_chunk(1 * MiB) == 64 * 1024
    assert auto_chunk(4 * MiB) == 256 * 1024
    assert auto_chunk(64 * MiB) == 4 * MiB
    assert auto_chunk(2**30) == 8 * MiB
    assert auto_chunk(1000) == 64 * 1024


def test_engine_bench_smoke_run_writes_its_json(cpu_bench, tmp_path, capsys):
    assert be.main(["--out", str(tmp_path), "--quick", "--no-pageable", "--trials", "1"]) == 0
    files = list(tmp_path.glob("scaleup-engine-cpu-*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert result["command"].startswith("python -m bench.transfers.engine --out")
    assert [r["size_bytes"] for r in result["rows"]] == [1 * MiB, 4 * MiB, 16 * MiB]
    assert all(r["engine_h2d_exact"] for r in result["rows"])
    assert "eng H2D" in capsys.readouterr().out


def test_prediction_script_writes_labelled_json(tmp_path):
    data = predict.predict(counts=(1, 2), nbytes=256 * MiB)
    text = json.dumps(data)
    assert "PREDICTION" in data["what"] and "assumptions" in text
    assert "-m bench.transfers.predict" in data["command"]
    dgx = data["scenarios"]["DGX H200 (PCIe Gen5 + NVSwitch)"]["rows"]
    assert dgx[1]["gain"] > 1.9
