"""A recording stand-in for torch_npu, so the npu backend can be tested without an Ascend NPU.

It imitates the part of ``torch.npu`` that ``backends/npu.py`` calls, with the signatures
torch_npu documents, and appends every call to ``FakeNpu.calls`` as ``(name, args, kwargs)``
so tests can assert what the backend asked for. It performs no device work: streams and
events are plain objects, memory figures are configured numbers.

Install it with :func:`install`, which uses pytest's ``monkeypatch`` so everything is undone
after the test. It never registers an ``npu`` device type with torch (that is process-wide),
so ``torch.device("npu")`` still fails under the stand-in; tests that need real NPU tensors
are skipped.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["FakeNpu", "FakeNpurt", "install", "SAMPLE_910B_TOPO", "SAMPLE_PCIE_TOPO", "SAMPLE_A3_TOPO"]

Call = tuple[str, tuple, dict]


class FakeNpurt:
    """``torch.npu.npurt()``: records host (un)registration and returns configured ACL codes."""

    def __init__(self, npu: "FakeNpu", register_rc: int = 0, unregister_rc: int = 0) -> None:
        self._npu = npu
        self.register_rc = register_rc
        self.unregister_rc = unregister_rc

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self._npu._record("npurt.npuHostRegister", ptr, size, flags)
        return self.register_rc

    def npuHostUnregister(self, ptr: int) -> int:
        self._npu._record("npurt.npuHostUnregister", ptr)
        return self.unregister_rc


class _FakeStreamBase:
    """``torch.npu.Stream(device=None, priority=0)``; the subclass made per FakeNpu records creation."""

    _npu: "FakeNpu"

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self._npu._record("Stream", device=device, priority=priority, **kwargs)
        self.device = device
        self.priority = priority
        self.npu_stream = 0x1000 + 0x10 * len(self._npu.named("Stream"))  # the aclrtStream handle

    def wait_event(self, event: Any) -> None:
        self._npu._record("Stream.wait_event", event)

    def wait_stream(self, stream: Any) -> None:
        self._npu._record("Stream.wait_stream", stream)

    def record_event(self, event: Any = None) -> Any:
        self._npu._record("Stream.record_event", event)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._npu._record("Stream.synchronize")


class _FakeEventBase:
    """``torch.npu.Event(enable_timing=False, blocking=False, interprocess=False)``."""

    _npu: "FakeNpu"

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._npu._record("Event", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        self._npu._record("Event.record", stream)

    def wait(self, stream: Any = None) -> None:
        self._npu._record("Event.wait", stream)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._npu._record("Event.synchronize")

    def elapsed_time(self, end: Any) -> float:
        return 1.0


class FakeNpu:
    """The ``torch.npu`` namespace as the npu backend uses it.

    Args:
        device_count: NPUs visible.
        name: ``get_device_properties(i).name`` (``"Ascend910B3"``, ``"Ascend910_9392"``).
        total: HBM bytes per device (``mem_get_info`` total and ``total_memory``).
        free: ``mem_get_info`` free bytes.
        reserved / allocated: ``memory_reserved`` / ``memory_allocated`` per device.
        peer: ``(a, b) -> bool`` for ``can_device_access_peer``; default all pairs True.
        npurt: whether ``torch.npu.npurt`` exists (absent on torch_npu release branches).
        available: ``is_available()``.
    """

    def __init__(self, device_count: int = 8, name: str = "Ascend910B3", total: int = 64 * 2**30,
                 free: int = 60 * 2**30, reserved: int = 2 * 2**30, allocated: int = 2**30,
                 peer: Callable[[int, int], bool] | None = None, npurt: bool = True, available: bool = True) -> None:
        self.calls: list[Call] = []
        self._count = device_count
        self._name = name
        self._total = total
        self._free = free
        self._reserved = reserved
        self._allocated = allocated
        self._peer = peer or (lambda a, b: True)
        self._available = available
        self._current = 0
        self.Stream = type("Stream", (_FakeStreamBase,), {"_npu": self})
        self.Event = type("Event", (_FakeEventBase,), {"_npu": self})
        self.npurt_obj = FakeNpurt(self)
        if npurt:
            self.npurt = self._npurt  # only present when asked: the backend tests hasattr

    # ------------------------------------------------------------------ recording
    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def named(self, name: str) -> list[Call]:
        """The recorded calls called ``name``, in order."""
        return [c for c in self.calls if c[0] == name]

    # ------------------------------------------------------------------ API
    def is_available(self) -> bool:
        self._record("is_available")
        return self._available

    def device_count(self) -> int:
        self._record("device_count")
        return self._count

    def current_device(self) -> int:
        self._record("current_device")
        return self._current

    def set_device(self, index: int) -> None:
        self._record("set_device", index)
        self._current = index

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        self._record("device", index)
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous

    def current_stream(self, device: Any = None) -> Any:
        self._record("current_stream", device)
        return ("current_stream", device)

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        self._record("stream", stream)
        yield stream

    def synchronize(self, device: Any = None) -> None:
        self._record("synchronize", device)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._record("mem_get_info", device)
        return self._free, self._total

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        self._record("set_per_process_memory_fraction", fraction, device)

    def memory_allocated(self, device: Any = None) -> int:
        self._record("memory_allocated", device)
        return self._allocated

    def memory_reserved(self, device: Any = None) -> int:
        self._record("memory_reserved", device)
        return self._reserved

    def max_memory_allocated(self, device: Any = None) -> int:
        self._record("max_memory_allocated", device)
        return self._allocated + 1

    def max_memory_reserved(self, device: Any = None) -> int:
        self._record("max_memory_reserved", device)
        return self._reserved + 1

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._record("reset_peak_memory_stats", device)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """The allocator's segments: ``self.segments``, set by a test (none by default)."""
        self._record("memory_snapshot")
        return list(getattr(self, "segments", []))

    def get_device_properties(self, device: int) -> types.SimpleNamespace:
        self._record("get_device_properties", device)
        return types.SimpleNamespace(name=self._name, total_memory=self._total, uuid=f"fake-uuid-{device}")

    def can_device_access_peer(self, a: int, b: int) -> bool:
        self._record("can_device_access_peer", a, b)
        return bool(self._peer(a, b))

    def _npurt(self) -> FakeNpurt:
        self._record("npurt")
        return self.npurt_obj


def install(monkeypatch: Any, **kwargs: Any) -> FakeNpu:
    """Make ``import torch_npu`` and ``torch.npu`` resolve to a new :class:`FakeNpu`.

    Undone by ``monkeypatch`` at the end of the test. Keyword arguments go to FakeNpu.
    """
    fake = FakeNpu(**kwargs)
    module = types.ModuleType("torch_npu")
    module.npu = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake


# ---------------------------------------------------------------------------- npu-smi samples

#: The legend `npu-smi info -t topo` prints under every matrix.
_LEGEND = """
Legend:

  X    = Self
  SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, UPI.
  PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.
  PIX  = Path traversing a single PCIe switch
  PXB  = Path traversing multiple PCIe switches
  HCCS = Connection traversing HCCS.
  NA   = Unknown relationship.
"""

#: 8 x Ascend 910B3 (Atlas 800T A2), HCCS full mesh, as published in the ms-swift NPU docs.
SAMPLE_910B_TOPO = """\
\t   NPU0       NPU1       NPU2       NPU3       NPU4       NPU5       NPU6       NPU7       CPU Affinity
NPU0       X          HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       144-167
NPU1       HCCS       X          HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       144-167
NPU2       HCCS       HCCS       X          HCCS       HCCS       HCCS       HCCS       HCCS       96-119
NPU3       HCCS       HCCS       HCCS       X          HCCS       HCCS       HCCS       HCCS       96-119
NPU4       HCCS       HCCS       HCCS       HCCS       X          HCCS       HCCS       HCCS       0-23
NPU5       HCCS       HCCS       HCCS       HCCS       HCCS       X          HCCS       HCCS       0-23
NPU6       HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       X          HCCS       48-71
NPU7       HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       HCCS       X          48-71
""" + _LEGEND

#: A hand-written PCIe-only 4-NPU host: pairs under one switch (PIX), one host bridge
#: (PHB) within a socket, SMP across sockets (SYS). Not a captured output.
SAMPLE_PCIE_TOPO = """\
           NPU0       NPU1       NPU2       NPU3       CPU Affinity
NPU0       X          PIX        SYS        SYS        0-31
NPU1       PIX        X          SYS        SYS        0-31
NPU2       SYS        SYS        X          PHB        32-63
NPU3       SYS        SYS        PHB        X          32-63
""" + _LEGEND

#: Two dies of one 910C in a container (A3), as printed in an sglang issue: host Phy-IDs,
#: SIO between them, no CPU Affinity column.
SAMPLE_A3_TOPO = """\
           Phy-ID12   Phy-ID13
Phy-ID12   X          SIO
Phy-ID13   SIO        X

Legend:

  X    = Self
  SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, UPI.
  PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.
  PIX  = Path traversing a single PCIe switch
  PXB  = Path traversing multipul PCIe switches
  HCCS = Connection traversing HCCS.
  SIO  = Path traversing the SIO bus
  HCCS_SW = Connection traversing HCCS through a switch
  NA   = Unknown relationship.
"""
