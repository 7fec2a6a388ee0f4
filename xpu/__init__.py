"""xpu: a small device-agnostic transfer-and-compute interface.

    import xpu
    backend = xpu.get_backend()          # XPU_BACKEND=cuda|npu|cpu, or auto-detected
    if backend.caps.dha:
        w_dev = backend.device_view(backend.host_arena.empty((4096, 4096), torch.bfloat16))

Strategies and the scaleup copier talk to a :class:`Backend` only, and branch on
:class:`Capabilities`, never on a backend's name.
"""
from .arena import ArenaStats, HostArena
from .backend import Backend, BufferHandle, MemoryStats
from .capabilities import Capabilities
from .errors import (
    BackendUnavailableError,
    CapabilityError,
    DeviceOutOfMemoryError,
    HostMemoryBudgetError,
    UnknownBackendError,
    XpuError,
)
from .hostmem import in_host_memory
from .registry import backend_status, get_backend, register_backend, registered_backends, reset_backend
from .topology import HOST, DeviceSpec, Link, Topology, preset
from .units import format_bytes, parse_bytes

__all__ = [
    "ArenaStats", "HostArena", "Backend", "BufferHandle", "MemoryStats", "Capabilities",
    "BackendUnavailableError", "CapabilityError", "DeviceOutOfMemoryError", "HostMemoryBudgetError",
    "UnknownBackendError", "XpuError",
    "backend_status", "get_backend", "register_backend", "registered_backends", "reset_backend",
    "in_host_memory", "HOST", "DeviceSpec", "Link", "Topology", "preset", "format_bytes", "parse_bytes",
]

__version__ = "0.1.0"
