"""Systems register themselves (register_system, or an entry point of another package) and the harness runs them unchanged."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import bench.systems as systems
from bench.scenario import load_scenario
from bench.worker import run_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(systems.SYSTEMS, "_plugins", dict(systems.SYSTEMS._plugins))
    monkeypatch.setattr(systems.SYSTEMS, "_errors", [])
    monkeypatch.setattr(systems.SYSTEMS, "_discovered", False)
    yield systems


def _entry_points(monkeypatch, *eps):
    """Stand-in for the installed packages' ``xpu.bench_systems`` entry points."""
    from importlib.metadata import EntryPoint

    import xpu.plugins

    found = [EntryPoint(name, value, systems.ENTRY_POINT_GROUP) for name, value in eps]
    monkeypatch.setattr(xpu.plugins, "entry_points", lambda group: [e for e in found if e.group == group])


def test_another_package_registers_a_system_by_entry_point(tmp_path, monkeypatch, fresh_registry, cpu_backend):
    (tmp_path / "toypkg").mkdir()
    (tmp_path / "toypkg" / "__init__.py").write_text("")
    (tmp_path / "toypkg" / "register.py").write_text(textwrap.dedent('''
        from bench.systems import register_system
        register_system("toystrat", "toypkg.system:make", options={"scale": 1.0},
                        description="a toy strategy: the torch system under another name")
    '''))
    (tmp_path / "toypkg" / "system.py").write_text(textwrap.dedent('''
        from bench.systems.torch_ref import TorchSystem
        def make(ctx):
            ctx.options = {"precision": "pure", "recompute": False, "fused": True, "optimizer": True}
            return TorchSystem(ctx)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    _entry_points(monkeypatch, ("toy", "toypkg.register"), ("direct", "toypkg.system:make"))
    assert "toystrat" in systems.registered_systems()
    assert systems.get_system("direct").target == "toypkg.system:make"  # a target entry is registered as it is
    scenario = load_scenario("tiny", {"systems": [{"name": "toystrat", "options": {"scale": 2.0}}]})
    row = run_spec({"scenario": scenario.to_dict(), "label": "toystrat", "timeline_path": None}, in_process=True)
    assert row["status"] == "ok" and row["options"] == {"scale": 2.0}


def test_a_broken_registration_is_reported_not_fatal(tmp_path, monkeypatch, fresh_registry):
    (tmp_path / "brokenstrat.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _entry_points(monkeypatch, ("broken", "brokenstrat"))
    assert "torch" in systems.registered_systems()
    assert any("brokenstrat" in e and "boom" in e for e in systems.discovery_errors())


def test_missing_package_of_a_system_reads_missing(fresh_registry, cpu_backend):
    systems.register_system("needs-nothing-real", "bench.systems.torch_ref:make", requires=("no_such_pkg_xyz",))
    assert "no_such_pkg_xyz" in systems.missing_requirement(systems.get_system("needs-nothing-real"))


@pytest.mark.parametrize("body, status, reason", [
    ("    import no_such_pkg_xyz\n", "missing", "no_such_pkg_xyz"),  # an import error inside: the package is missing
    ("    raise ValueError('bad setup')\n", "error", "bad setup"),
])
def test_a_failing_system_factory_reads_missing_or_error(tmp_path, monkeypatch, fresh_registry, cpu_backend,
                                                         body, status, reason):
    module = f"odd_sys_{status}"  # a module name per case: the first import would be reused
    (tmp_path / f"{module}.py").write_text("def make(ctx):\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    systems.register_system("odd-sys", f"{module}:make")
    scenario = load_scenario("tiny", {"systems": ["odd-sys"]})
    row = run_spec({"scenario": scenario.to_dict(), "label": "odd-sys", "timeline_path": None}, in_process=True)
    assert row["status"] == status and reason in row["reason"]


def test_bench_never_calls_device_modules_directly():
    banned = re.compile(r"torch\.cuda\b|torch\.npu\b|\.cuda\(\)|\.npu\(\)|torch_npu")
    hits = []
    # The harness package itself; bench/scripts/ holds device diagnostics by design.
    paths = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "bench" / "systems").rglob("*.py"))
    assert len(paths) >= 10
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if banned.search(line.split("#", 1)[0]):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "use the xpu Backend in bench/:\n" + "\n".join(hits)


def test_a_host_built_model_is_not_device_memory_on_the_cpu_backend(cpu_backend):
    """The worker builds systems inside a device scope; a model a system builds on the host
    (no device given) must not count against the virtual device's cap."""
    import torch

    from bench.systems.base import SystemContext

    ctx = SystemContext(backend=cpu_backend, device_index=0, family="gpt",
                        dims=dict(layers=2, hidden=64, heads=4, vocab=256, seq=32), dtype=torch.float32, batch=2,
                        seq=32, optimizer={"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
    with cpu_backend.device_scope(0):
        before = cpu_backend.memory_stats(0).allocated
        host = ctx.build_model()
        after_host = cpu_backend.memory_stats(0).allocated
        on_device = ctx.build_model(device=ctx.device)
        after_device = cpu_backend.memory_stats(0).allocated
    nbytes = sum(p.numel() * p.element_size() for p in host.parameters())
    assert after_host == before
    assert after_device - after_host >= nbytes  # built on the device: counted
    del on_device


def test_a_system_s_setup_peak_is_reported_apart_from_its_steps(tmp_path, monkeypatch, fresh_registry, cpu_backend):
    """Setup (a planner's profiling, a rehearsal) may hold more than a step: the row's peak is the
    steps', and setup's peak is reported beside it; so are the allocator's retries (allocations
    made only after freeing its cache: stalls on CUDA), the steps' alone."""
    import dataclasses
    import sys

    (tmp_path / "setup_peak_sys.py").write_text(textwrap.dedent("""
        import torch

        RETRIES = [0]  # what the patched allocator counters report

        class System:
            def __init__(self, ctx):
                self.ctx = ctx

            def step(self, inputs, targets):
                self.kept = self.ctx.backend.to_device(torch.zeros(1 << 16), self.ctx.device_index)  # 256 KiB
                RETRIES[0] += 2
                return None

        def make(ctx):
            big = ctx.backend.to_device(torch.zeros(1 << 20), ctx.device_index)  # 4 MiB, setup only
            del big
            RETRIES[0] += 5
            return System(ctx)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    systems.register_system("setup-peak", "setup_peak_sys:make")
    real = type(cpu_backend).memory_stats
    monkeypatch.setattr(type(cpu_backend), "memory_stats", lambda self, device=None: dataclasses.replace(
        real(self, device), alloc_retries=sys.modules["setup_peak_sys"].RETRIES[0] if "setup_peak_sys" in sys.modules
        else 0))
    scenario = load_scenario("tiny", {"systems": ["setup-peak"]})
    row = run_spec({"scenario": scenario.to_dict(), "label": "setup-peak", "timeline_path": None}, in_process=True)
    assert row["status"] == "ok", row.get("reason")
    assert row["setup_peak_device_gb"] >= 4 * 2**20 / 1e9
    assert row["peak_device_gb"] < 2 * 2**20 / 1e9
    assert row["alloc_retries"] == 2 * len(row["step_times_s"])
