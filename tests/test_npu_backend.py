"""Tests of the NPU backend (backends/npu*.py) against the recording stand-in torch_npu (tests/fake_torch_npu.py).

They check what the backend asks torch_npu for (names, device indices, flags, sizes), the
host-registration arithmetic, the npu-smi parser and the registry's choice. Nothing here
touches an NPU; the tests at the end that need one are skipped without it.
"""
from __future__ import annotations

import gc
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

import backends.npu as npu_mod
import backends.npu_hostreg as hostreg_mod
import backends.npu_topology as topo_mod
import fake_torch_npu as fake_npu
from backends.npu import NpuBackend
from fake_torch_npu import SAMPLE_910B_TOPO
from xpu import registry
from xpu.errors import BackendUnavailableError, CapabilityError, XpuError

GiB = 2**30
PAGE = 4096
MAPPED = 0x2  # ACL_HOST_REG_MAPPED, written out so a wrong constant in the backend fails here


@pytest.fixture
def clean_env(monkeypatch):
    """No NPU-related environment leaks in, and the registry forgets its backend around the test."""
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "PYTORCH_NPU_ALLOC_CONF", "XPU_HOST_MEM_BUDGET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XPU_BACKEND", "npu")
    registry.reset_backend()
    yield monkeypatch
    registry.reset_backend()


@pytest.fixture
def install(clean_env):
    """A function installing the stand-in (keyword arguments go to FakeNpu) with an 8 x 910B npu-smi."""

    def _install(topo_text: str = SAMPLE_910B_TOPO, **kwargs) -> fake_npu.FakeNpu:
        fake = fake_npu.install(clean_env, **kwargs)
        clean_env.setattr(topo_mod, "_run_npu_smi_topo", lambda timeout=10.0: topo_text)
        return fake

    return _install


@pytest.fixture
def fake(install) -> fake_npu.FakeNpu:
    """The default stand-in: 8 x Ascend910B3 with npurt, all peers reachable."""
    return install()


@pytest.fixture
def backend(fake) -> NpuBackend:
    return NpuBackend()


def _collect() -> None:
    """Let finalizers of dropped storages run (refcounting frees them; gen 0 catches a cycle, and is fast)."""
    gc.collect(0)


def _register_calls(fake):
    return [c[1] for c in fake.named("npurt.npuHostRegister")]


def _unregister_calls(fake):
    return [c[1][0] for c in fake.named("npurt.npuHostUnregister")]


# ---------------------------------------------------------------------------- selection
def test_registry_selects_npu_with_stand_in(fake):
    chosen = registry.get_backend()
    assert isinstance(chosen, NpuBackend)
    assert (chosen.name, chosen.device_type, chosen.dist_backend, chosen.visible_devices_env) == (
        "npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    assert registry.backend_status()["npu"] is None


def test_registry_autodetect_prefers_npu(fake, monkeypatch):
    monkeypatch.delenv("XPU_BACKEND")
    assert isinstance(registry.get_backend(), NpuBackend)


def test_registry_reports_missing_torch_npu(clean_env):
    clean_env.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    clean_env.delattr(torch, "npu", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"backend 'npu' is not usable here: torch_npu could not be imported \((ModuleNotFound|Import)Error: import of torch_npu halted"):
        registry.get_backend()


def test_no_devices_gives_reason(install):
    install(device_count=0)
    reason = NpuBackend.unavailable_reason()
    assert reason is not None and "torch_npu sees no NPU" in reason and "npu-smi info" in reason


@pytest.mark.parametrize("value", ["0,2,1", "1,1", "3,2"])
def test_non_ascending_visible_devices_is_unavailable(install, monkeypatch, value):
    fake = install()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", value)
    reason = NpuBackend.unavailable_reason()
    assert reason is not None
    assert "not strictly ascending" in reason and "returns 0 devices" in reason and repr(value) in reason
    assert fake.named("device_count") == []  # decided from the variable, before asking torch_npu
    with pytest.raises(BackendUnavailableError, match="not strictly ascending"):
        registry.get_backend()


def test_ascending_visible_devices_is_fine(install, monkeypatch):
    install(device_count=2)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,5")
    assert NpuBackend.unavailable_reason() is None


def test_unavailable_reason_touches_no_device_state(fake):
    assert NpuBackend.unavailable_reason() is None
    assert {c[0] for c in fake.calls} <= {"is_available", "device_count"}


# ---------------------------------------------------------------------------- capabilities
def test_caps_default(backend):
    caps = backend.caps
    assert (caps.dha, caps.peer_access, caps.ipc, caps.async_copy, caps.host_register, caps.timing_events) == (
        False, True, False, True, True, True)


def test_caps_without_npurt_or_peers(install):
    install(npurt=False, peer=lambda a, b: a < b)  # only one direction for every pair
    caps = NpuBackend().caps
    assert caps.host_register is False
    assert caps.peer_access is False


def test_pinned_mem_register_alone_does_not_grant_dha(backend, monkeypatch):
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:False,pinned_mem_register:True")
    assert backend.caps.dha is False
    routes = backend.dha_routes()
    assert "get_npu_view_from_cpu_tensor" in routes["vllm_ascend_op"]
    assert "device-pointer getter" in routes["npurt_pinned_register"]


# ---------------------------------------------------------------------------- streams and events
def test_stream_passes_device_and_priority(backend, fake):
    stream = backend.stream(3, priority=-1)
    assert fake.named("Stream") == [("Stream", (), {"device": 3, "priority": -1})]
    assert (stream.device, stream.priority) == (3, -1)
    backend.stream()
    assert fake.named("Stream")[-1][2] == {"device": 0, "priority": 0}  # the current device
    with pytest.raises(ValueError, match="out of range"):
        backend.stream(8)


def test_event_timing_flag(backend, fake):
    backend.event(timing=True)
    backend.event()
    assert [c[2]["enable_timing"] for c in fake.named("Event")] == [True, False]


def test_stream_helpers_go_through_torch_npu(backend, fake):
    assert backend.current_stream(2) == ("current_stream", 2)
    backend.synchronize(1)
    assert fake.named("synchronize") == [("synchronize", (1,), {})]
    with backend.device_scope(5):
        assert backend.current_device() == 5
    assert fake.named("device") == [("device", (5,), {})]
    s = backend.stream(0)
    with backend.use_stream(s):
        pass
    assert fake.named("stream") == [("stream", (s,), {})]


def test_copy_is_non_blocking_only_from_pinned_memory(backend, fake):
    src_pinned = backend.alloc_pinned(256)
    src_plain = torch.zeros(256, dtype=torch.uint8)
    dst = backend.alloc_pinned(256)  # host to host keeps the test off devices; both sides count
    seen = []
    dst.copy_ = lambda src, non_blocking=False: seen.append((src.data_ptr(), non_blocking))  # type: ignore[method-assign]
    stream = backend.stream(0)
    backend.copy(dst, src_pinned, stream)
    backend.copy(dst, src_plain)
    assert seen == [(src_pinned.data_ptr(), True), (src_plain.data_ptr(), False)]
    assert fake.named("stream") == [("stream", (stream,), {})]


def test_copy_many_copies_each_pair_in_one_stream_context(backend, fake):
    srcs = [backend.alloc_pinned(64), torch.zeros(32, dtype=torch.uint8)]
    dsts = [backend.alloc_pinned(64), backend.alloc_pinned(32)]
    srcs[0].fill_(3)
    srcs[1].fill_(5)
    stream = backend.stream(0)
    backend.copy_many(dsts, srcs, stream)
    assert int(dsts[0].sum()) == 3 * 64 and int(dsts[1].sum()) == 5 * 32
    assert fake.named("stream") == [("stream", (stream,), {})]  # one context for both
    with pytest.raises(ValueError, match="pair 0 has dst"):
        backend.copy_many([dsts[1]], [srcs[0]])


# ---------------------------------------------------------------------------- memory
def test_set_memory_cap_sets_fraction_of_device_total(backend, fake):
    backend.set_memory_cap(2, 16 * GiB)
    assert fake.named("set_per_process_memory_fraction") == [("set_per_process_memory_fraction", (0.25, 2), {})]
    assert backend.memory_cap(2) == 16 * GiB
    backend.set_memory_cap(2, None)
    assert fake.named("set_per_process_memory_fraction")[-1][1] == (1.0, 2)
    assert backend.memory_cap(2) is None
    with pytest.raises(ValueError, match="at most"):
        backend.set_memory_cap(1, 65 * GiB)
    assert len(fake.named("set_per_process_memory_fraction")) == 2


def test_mem_info_under_cap(backend, fake):
    assert backend.mem_info(1) == (60 * GiB, 64 * GiB)
    backend.set_memory_cap(1, "16GiB")
    # capped total; free is what the cap leaves after this process's reserved 2 GiB
    assert backend.mem_info(1) == (14 * GiB, 16 * GiB)
    assert ("mem_get_info", (1,), {}) in fake.calls
    assert ("memory_reserved", (1,), {}) in fake.calls


def test_memory_stats_and_peak_reset_use_torch_npu(backend, fake):
    stats = backend.memory_stats(3)
    assert (stats.allocated, stats.reserved, stats.peak_allocated, stats.peak_reserved) == (GiB, 2 * GiB, GiB + 1, 2 * GiB + 1)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        assert fake.named(name) == [(name, (3,), {})]
    backend.reset_peak_memory(3)
    assert fake.named("reset_peak_memory_stats") == [("reset_peak_memory_stats", (3,), {})]


def test_reserved_by_stream_reads_the_snapshot_and_names_the_callers_streams(backend, fake, monkeypatch):
    side = backend.stream(3)
    fake.segments = [
        {"device": 3, "stream": 0, "total_size": 3 * GiB, "allocated_size": GiB, "blocks": []},
        {"device": 3, "stream": side.npu_stream, "total_size": GiB, "allocated_size": 0,
         "blocks": [{"size": GiB // 2, "state": "active_pending_free"}]},
        {"device": 1, "stream": 0, "total_size": 9 * GiB, "allocated_size": 0, "blocks": []},
    ]
    pools = backend.reserved_by_stream(3, {"side": side})
    assert pools == {"default": (3 * GiB, GiB, 0), "side": (GiB, 0, GiB // 2)}
    monkeypatch.delattr(type(fake), "memory_snapshot")  # an older torch_npu without one: nothing to say
    assert backend.reserved_by_stream(3) == {}


# ---------------------------------------------------------------------------- host memory
def test_register_host_aligns_address_and_pads_size(backend, fake):
    base = torch.empty(4 * PAGE, dtype=torch.uint8)
    offset = (-base.data_ptr()) % PAGE + 100  # 100 bytes past a page boundary
    t = base[offset:offset + 5000]
    ptr = t.data_ptr()
    backend.register_host(t)
    start = ptr - 100
    end = start + 2 * PAGE  # bytes [ptr, ptr+5000) end 5100 bytes past start: two pages
    assert _register_calls(fake) == [(start, end - start, MAPPED)]
    assert backend.is_pinned(t) and backend.is_pinned(t[10:20])
    assert not backend.is_pinned(base[offset + 2 * PAGE:offset + 2 * PAGE + 8])
    backend.unregister_host(t)
    assert _unregister_calls(fake) == [start]
    assert not backend.is_pinned(t)
    del t
    _collect()
    assert _unregister_calls(fake) == [start]  # not again from the garbage collector


def test_register_host_inside_and_overlapping_earlier_registration(backend, fake):
    base = torch.empty(4 * PAGE, dtype=torch.uint8)
    offset = (-base.data_ptr()) % PAGE
    first = base[offset:offset + 100]
    backend.register_host(first)
    backend.register_host(base[offset + 200:offset + 300])  # same page: already registered
    assert len(_register_calls(fake)) == 1
    with pytest.raises(ValueError, match="overlaps an earlier registration"):
        backend.register_host(base[offset + 50:offset + 5000])  # reaches into the next page
    assert len(_register_calls(fake)) == 1


def test_register_host_needs_npurt(install):
    install(npurt=False)
    backend = NpuBackend()
    with pytest.raises(CapabilityError, match="npurt"):
        backend.register_host(torch.empty(PAGE, dtype=torch.uint8))
    with pytest.raises(CapabilityError, match="npurt"):
        backend.unregister_host(torch.empty(PAGE, dtype=torch.uint8))


def test_register_host_rejects_non_contiguous(backend):
    with pytest.raises(ValueError, match="contiguous host tensor"):
        backend.register_host(torch.empty(16, 16)[:, 0])


def test_register_host_failure_is_reported(backend, fake):
    fake.npurt_obj.register_rc = 107000
    t = torch.empty(PAGE, dtype=torch.uint8)
    with pytest.raises(XpuError, match="ACL error 107000"):
        backend.register_host(t)
    assert not backend.is_pinned(t)


def test_failed_unregister_keeps_the_record(backend, fake):
    t = torch.empty(PAGE, dtype=torch.uint8)
    backend.register_host(t)
    fake.npurt_obj.unregister_rc = 507899
    with pytest.raises(XpuError, match="ACL error 507899"):
        backend.unregister_host(t)
    assert backend.is_pinned(t)
    fake.npurt_obj.unregister_rc = 0
    backend.unregister_host(t)  # a retry works
    assert not backend.is_pinned(t)


def test_registration_is_undone_when_tensor_is_collected(backend, fake):
    t = torch.empty(3 * PAGE, dtype=torch.uint8)
    backend.register_host(t)
    start = _register_calls(fake)[0][0]
    view = t[5:10]
    del t
    _collect()
    assert _unregister_calls(fake) == []  # a view still holds the storage
    del view
    _collect()
    assert _unregister_calls(fake) == [start]


def test_alloc_pinned_registers_exact_size_pages(backend, fake):
    buf = backend.alloc_pinned(5000)
    assert (buf.dtype, buf.numel(), buf.device.type) == (torch.uint8, 5000, "cpu")
    ptr = buf.data_ptr()
    assert ptr % PAGE == 0
    assert _register_calls(fake) == [(ptr, 2 * PAGE, MAPPED)]
    assert backend.is_pinned(buf) and backend.is_pinned(buf[4000:4100])
    buf[:] = 7  # the mapping is writable memory
    backend.free_pinned(buf)
    backend.free_pinned(buf)
    assert _unregister_calls(fake) == [ptr]
    del buf
    _collect()
    assert _unregister_calls(fake) == [ptr]


def test_alloc_pinned_unregisters_on_collection(backend, fake):
    buf = backend.alloc_pinned(PAGE)
    ptr = buf.data_ptr()
    del buf
    _collect()
    assert _unregister_calls(fake) == [ptr]


def test_alloc_pinned_falls_back_once_registration_fails(backend, fake, monkeypatch, caplog):
    made = []
    monkeypatch.setattr(npu_mod, "_pinned_by_torch", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    fake.npurt_obj.register_rc = 107000
    with caplog.at_level(logging.WARNING, logger="xpu"):
        a = backend.alloc_pinned(3000)
        b = backend.alloc_pinned(5000)
    assert (a.numel(), b.numel()) == (3000, 5000)
    assert made == [3000, 5000]
    assert len(_register_calls(fake)) == 1  # not retried for every buffer
    assert "ACL error 107000" in caplog.text and "falling back" in caplog.text


def test_alloc_pinned_without_npurt_uses_torch_pinned_allocator(install, monkeypatch):
    fake = install(npurt=False)
    made = []
    monkeypatch.setattr(npu_mod, "_pinned_by_torch", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    buf = NpuBackend().alloc_pinned(1234)
    assert buf.numel() == 1234 and made == [1234]
    assert not [c for c in fake.calls if c[0].startswith("npurt")]


def test_host_arena_uses_registered_buffers(backend, fake):
    arena = backend.host_arena
    t = arena.empty((250,), dtype=torch.float32)
    assert len(_register_calls(fake)) == 1 and backend.is_pinned(t)
    arena.release(t)
    assert arena.trim() == 1000
    assert len(_unregister_calls(fake)) == 1


# ---------------------------------------------------------------------------- device view
def test_device_view_without_dha_raises_capability_error(backend):
    with pytest.raises(CapabilityError, match=r"caps.dha is False.*get_npu_view_from_cpu_tensor"):
        backend.device_view(backend.alloc_pinned(PAGE))


def test_device_view_uses_vllm_ascend_op_on_the_requested_device(backend, fake, monkeypatch):
    seen = []

    def op(cpu):
        seen.append((cpu.data_ptr(), cpu.shape, fake._current))
        return "npu-view" if len(seen) == 1 else None

    monkeypatch.setattr(torch.ops._C_ascend, "get_npu_view_from_cpu_tensor", op, raising=False)
    assert backend.caps.dha is True
    host = backend.alloc_pinned(4 * PAGE).view(torch.float32).view(64, 64)
    assert backend.device_view(host, 3) == "npu-view"
    assert seen == [(host.data_ptr(), torch.Size([64, 64]), 3)]
    with pytest.raises(ValueError, match="not device-mapped"):
        backend.device_view(host, 3)  # the op answers None for unmapped memory
    with pytest.raises(ValueError, match="needs pinned host memory"):
        backend.device_view(torch.zeros(8), 0)


# ---------------------------------------------------------------------------- peers
def test_can_access_peer_checks_both_directions(install):
    fake = install(peer=lambda a, b: (a, b) in {(0, 1), (2, 3), (3, 2)})
    backend = NpuBackend()
    assert backend.can_access_peer(0, 1) is False
    assert ("can_device_access_peer", (0, 1), {}) in fake.calls and ("can_device_access_peer", (1, 0), {}) in fake.calls
    assert backend.can_access_peer(2, 3) is True
    assert backend.can_access_peer(3, 3) is False
    assert backend.enable_peer_access(3, 2) is True
    assert backend.caps.peer_access is True


def test_describe_reports_routes(backend):
    info = backend.describe()
    assert info["backend"] == "npu" and info["device_count"] == 8 and info["npurt"] is True
    assert set(info["dha_routes"]) == {"vllm_ascend_op", "npurt_pinned_register"}


def test_backend_files_never_name_torch_cuda():
    for module in (npu_mod, topo_mod, hostreg_mod):
        text = Path(module.__file__).read_text()
        assert "torch.cuda" not in text and ".cuda(" not in text, module.__name__


# ---------------------------------------------------------------------------- real hardware
def _real_npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        import torch_npu  # noqa: F401

        return torch.npu.device_count()  # type: ignore[attr-defined]
    except Exception:
        return 0


needs_npu = pytest.mark.skipif(_real_npu_count() == 0, reason="needs an Ascend NPU")


@needs_npu
def test_real_pinned_round_trip():
    backend = NpuBackend()
    host = backend.alloc_pinned(1 << 20)
    host.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    dev = backend.empty(host.shape, torch.uint8, 0)
    stream = backend.stream(0)
    backend.copy(dev, host, stream)
    back = torch.empty_like(host)
    backend.copy(back, dev, stream)
    stream.synchronize()
    assert torch.equal(back, host)
    backend.free_pinned(host)


@needs_npu
def test_real_device_view():
    backend = NpuBackend()
    if not backend.caps.dha:
        pytest.skip("no device-view route (vllm-ascend's op) in this environment")
    host = backend.alloc_pinned(4096).view(torch.float32)
    host.fill_(2.0)
    view = backend.device_view(host, 0)
    assert view.device.type == "npu" and float((view * 2).sum().cpu()) == 4.0 * host.numel()
