"""The capability record that strategies branch on instead of a backend's name."""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do in this process.

    A missing capability means a slower, still correct path: strategies check these flags and
    never ``backend.name``.

    Attributes:
        dha: device kernels can read and write pinned, device-mapped host memory
            (``Backend.device_view`` works): Direct Host Access.
        peer_access: at least one pair of devices can copy to each other directly
            (NVLink, HCCS, PCIe P2P); ask ``Backend.can_access_peer`` per pair.
        ipc: a device buffer can be opened by another process (CUDA IPC handles, shared
            memory on the cpu backend).
        async_copy: copies from pinned host memory run asynchronously on a stream, so they
            overlap with compute.
        host_register: an existing host tensor can be pinned in place
            (``Backend.register_host``).
        timing_events: events can measure elapsed time between two records.
        triton: Triton kernels compile and run on the devices, over ``device_view`` tensors
            too (``xpu.triton_dha``).
        virtual_devices: the devices are budgeted slices of host memory (the cpu reference
            backend): device tensors are torch CPU tensors, other libraries (DeepSpeed, the
            profiler, torch's allocator statistics) see no device, and any number of devices
            can be made up for a child process (``Backend.env_for_device_count``); a copy between
            the host and a device is a host memory copy, not traffic on a link.
    """

    dha: bool = False
    peer_access: bool = False
    ipc: bool = False
    async_copy: bool = False
    host_register: bool = False
    timing_events: bool = True
    triton: bool = False
    virtual_devices: bool = False

    def as_dict(self) -> dict[str, bool]:
        """The flags as a plain dict, for JSON and tables."""
        return asdict(self)
