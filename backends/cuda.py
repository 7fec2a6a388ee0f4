"""CUDA GPUs through torch.cuda, with NVML (pynvml) for topology.

Host memory: exact-size buffers are page-aligned anonymous mappings registered with
``cudaHostRegister(Portable | Mapped)``, so they are DMA-fast, device-mapped (DHA) and never
rounded up to a power of two as torch's caching host allocator does. Under unified virtual
addressing (64-bit Linux) the device address of such memory equals its host address, which
is how ``device_view`` builds a CUDA tensor over host memory without a C++ extension.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Mapping

import torch

from xpu.backend import Backend, MemoryStats
from xpu.capabilities import Capabilities
from xpu.hostmem import mapped_buffer
from xpu.stream_pools import StreamPool, by_stream
from xpu.topology import HOST, DeviceSpec, Link, Topology

__all__ = ["CudaBackend", "pcie_GBps", "nvlink_GBps_per_link"]

_REGISTER_PORTABLE, _REGISTER_MAPPED = 0x1, 0x2
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered

# Per-lane, per-direction payload rate in GB/s after line coding (PCIe 3+ uses 128b/130b).
_PCIE_LANE_GBps = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# Per-link, per-direction NVLink rate in GB/s by NVLink version.
_NVLINK_LINK_GBps = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


def pcie_GBps(generation: int, width: int) -> float:
    """Nominal one-direction PCIe rate for a generation and lane count."""
    return _PCIE_LANE_GBps.get(generation, _PCIE_LANE_GBps[5]) * width


def nvlink_GBps_per_link(version: int) -> float:
    """Nominal one-direction rate of one NVLink of a given version."""
    return _NVLINK_LINK_GBps.get(version, 25.0)


def _check(err: Any, what: str) -> int:
    code = int(getattr(err, "value", err))
    if code not in (0, _ALREADY_REGISTERED):
        raise RuntimeError(f"{what} failed with CUDA error {code} ({err})")
    return code


def _has_triton() -> bool:
    """Whether Triton is installed and torch judges this GPU able to run its kernels."""
    from xpu import triton_dha

    if not triton_dha.available():
        return False
    try:
        from torch.utils._triton import has_triton  # checks the device's compute capability too
    except ImportError:
        return True
    return bool(has_triton())


class _HostAlias:
    """Presents a host address as CUDA memory (``__cuda_array_interface__``) and keeps its owner alive."""

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class CudaBackend(Backend):
    """NVIDIA GPUs."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None); install a CUDA build of torch"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"torch sees no CUDA device{hint}: check the NVIDIA driver with nvidia-smi"
        return None

    def __init__(self) -> None:
        super().__init__()
        self._registered: dict[int, int] = {}  # host address -> registered bytes
        self._reg_lock = threading.Lock()
        self._topology: Topology | None = None
        self._expandable = False  # avoid_fragmentation turned expandable segments on

    def _detect_caps(self) -> Capabilities:
        n = self.device_count()
        peer = any(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)
        uva = sys.platform.startswith("linux") and sys.maxsize > 2**32
        return Capabilities(dha=uva, peer_access=peer, ipc=sys.platform.startswith("linux"),
                            async_copy=True, host_register=True, timing_events=True, triton=_has_triton())

    # ------------------------------------------------------------------ identity
    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_scope(self, index: Any):
        return torch.cuda.device(self.index_of(index))

    def bind_process(self, index: Any) -> None:
        torch.cuda.set_device(self.index_of(index))

    # ------------------------------------------------------------------ streams and events
    def stream(self, device: Any = None, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device(device), priority=priority)

    def current_stream(self, device: Any = None) -> torch.cuda.Stream:
        # A torch.cuda.Stream, not the generic torch.Stream torch.accelerator returns: the
        # generic wait_event() does not see a torch.cuda.Event's record (seen on torch 2.11:
        # the wait was a no-op and a kernel read a buffer still being copied).
        return torch.cuda.current_stream(self.index_of(device))

    def event(self, timing: bool = False, blocking: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def use_stream(self, stream: torch.Stream):
        return torch.cuda.stream(stream)

    # ------------------------------------------------------------------ host memory
    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        nbytes = int(nbytes)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        # An anonymous mapping is page-aligned, so no two buffers share a page and each can be
        # registered (and unregistered) on its own.
        _, buf = mapped_buffer(nbytes)  # huge pages unless XPU_HOST_HUGEPAGES=0, faulted in
        self.register_host(buf)
        weakref.finalize(buf.untyped_storage(), self._unregister_ptr, buf.data_ptr())
        return buf

    def free_pinned(self, buffer: torch.Tensor) -> None:
        self._unregister_ptr(buffer.data_ptr())

    def register_host(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous host tensor")
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.is_pinned():
            return
        with self._reg_lock:
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE | _REGISTER_MAPPED)
            if _check(err, f"cudaHostRegister({nbytes} B)") == 0:
                self._registered[ptr] = nbytes

    def unregister_host(self, tensor: torch.Tensor) -> None:
        self._unregister_ptr(tensor.data_ptr())

    def _unregister_ptr(self, ptr: int) -> None:
        with self._reg_lock:
            if self._registered.pop(ptr, None) is not None:
                _check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")

    def device_view(self, host_tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        if not self.caps.dha:
            return super().device_view(host_tensor, device)
        if host_tensor.device.type != "cpu" or not host_tensor.is_pinned():
            raise ValueError("device_view needs pinned host memory; allocate it from host_arena or register_host it first")
        storage = host_tensor.untyped_storage()
        if storage.nbytes() == 0:
            return torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device(device))
        # Alias the whole storage as bytes, then lay the tensor's dtype, shape and strides on it.
        alias = torch.as_tensor(_HostAlias(host_tensor, storage.data_ptr(), storage.nbytes()), device=self.device(device))
        return alias.view(host_tensor.dtype).as_strided(host_tensor.shape, host_tensor.stride(), host_tensor.storage_offset())

    # ------------------------------------------------------------------ copies
    def can_access_peer(self, a: Any, b: Any) -> bool:
        a, b = self.index_of(a), self.index_of(b)
        return a != b and torch.cuda.can_device_access_peer(a, b)

    # ------------------------------------------------------------------ memory
    def _raw_mem_info(self, index: int) -> tuple[int, int]:
        return torch.cuda.mem_get_info(index)

    def memory_stats(self, device: Any = None) -> MemoryStats:
        i = self.index_of(device)
        torch.cuda.init()  # the allocator's counters exist only once CUDA is initialised
        return MemoryStats(torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i),
                           torch.cuda.max_memory_allocated(i), torch.cuda.max_memory_reserved(i),
                           int(torch.cuda.memory_stats(i).get("num_alloc_retries", 0)))

    def reserved_by_stream(self, device: Any = None,
                           streams: Mapping[str, Any] | None = None) -> dict[str, StreamPool]:
        # The snapshot's "stream" is the cudaStream_t handle, which a torch.cuda.Stream gives as cuda_stream.
        names = {s.cuda_stream: name for name, s in (streams or {}).items()}
        return by_stream(torch.cuda.memory_snapshot(), self.index_of(device), names)

    def reset_peak_memory(self, device: Any = None) -> None:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(self.index_of(device))

    def avoid_fragmentation(self) -> bool:
        said = _users_expandable_segments()
        if said is not None:  # the user chose; keep it
            return said
        # A 3.2 B plan under 16 GB failed a 3.9 GiB allocation with 2.7 GiB reserved but free
        # (H200, 2026-12-01): fixed-size cached blocks fragment as prefetch slots come and go.
        _set_allocator_settings("expandable_segments:True")
        self._expandable = True
        return True

    def cap_overshoot(self, device: Any = None) -> int:
        """One expandable-segment page (20 MiB) where segments expand, else 0: the allocator checks
        its memory fraction against the bytes asked, then maps whole pages (c10's
        ``try_allocate_expandable_block``), so reserved memory passed a plan's held cap by 11 MB
        on the H200 (session 24)."""
        self.index_of(device)
        on = _users_expandable_segments()
        return EXPANDABLE_PAGE if (self._expandable if on is None else on) else 0

    def _apply_memory_cap(self, index: int, nbytes: int | None) -> None:
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if nbytes is None else nbytes / total, index)

    # ------------------------------------------------------------------ topology
    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = _nvml_topology(self.device_count())
        return self._topology


#: The large pool's expandable-segment page: segments grow by whole pages (2 MiB in the small pool).
EXPANDABLE_PAGE = 20 << 20


def _users_expandable_segments() -> bool | None:
    """Whether the environment's allocator settings turn expandable segments on (None: not said)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    said = [item.split(":", 1) for item in conf.split(",") if item.strip().startswith("expandable_segments")]
    return said[-1][-1].strip().lower() == "true" if said else None


def _set_allocator_settings(settings: str) -> None:
    """Set the caching allocator's options (``PYTORCH_ALLOC_CONF`` syntax) at run time, through
    the accelerator-wide entry where torch has it (in torch 2.11 and 2.13 ``torch.cuda.memory``'s
    own is a deprecated alias of it, which warned in every GPU run's log)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def _torch_devices(n: int) -> tuple[DeviceSpec, ...]:
    out = []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        out.append(DeviceSpec(i, props.name, props.total_memory, uuid=str(getattr(props, "uuid", "")) or None))
    return tuple(out)


def _norm_uuid(u: Any) -> str:
    text = u.decode() if isinstance(u, bytes) else str(u)
    return text.lower().removeprefix("gpu-").replace("-", "")


def _nvml_topology(n: int) -> Topology:
    """Host and peer links from NVML, mapped to torch's logical indices by UUID."""
    devices = _torch_devices(n)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no NVML: report devices with a conservative PCIe Gen4 x16 guess
        links = [Link(HOST, d.index, "pcie", pcie_GBps(4, 16), detail="assumed; NVML unavailable") for d in devices]
        return Topology(devices, tuple(links + _peer_links_nvml_missed(n, links)), source=f"torch (NVML unavailable: {exc})")

    by_uuid = {}
    for k in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(k)
        by_uuid[_norm_uuid(pynvml.nvmlDeviceGetUUID(handle))] = handle
    handles, specs, links = [], [], []
    for d in devices:
        handle = by_uuid.get(_norm_uuid(d.uuid or ""))
        if handle is None:  # ignore-visible remap fallback: NVML index from CUDA_VISIBLE_DEVICES
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v for v in visible.split(",") if v.strip().isdigit()]
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(ids[d.index]) if d.index < len(ids) else d.index)
        handles.append(handle)
        numa = _try(lambda: pynvml.nvmlDeviceGetNumaNodeId(handle))
        if numa is None:
            numa = _sysfs_numa(_try(lambda: pynvml.nvmlDeviceGetPciInfo(handle).busId))
        specs.append(DeviceSpec(d.index, d.name, d.total_bytes, numa_node=numa, uuid=_try(lambda: str(pynvml.nvmlDeviceGetUUID(handle)))))
        # The current link generation drops at idle; the maximum is what a transfer gets.
        gen = _try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)) or 4
        gen = min(gen, _try(lambda: pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(handle)) or gen)
        width = _try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)) or 16
        links.append(Link(HOST, d.index, "pcie", pcie_GBps(gen, width), detail=f"PCIe Gen{gen} x{width}"))

    bus_to_index = {}
    for i, h in enumerate(handles):
        bus = _try(lambda: pynvml.nvmlDeviceGetPciInfo(h).busId)
        if bus is not None:
            bus_to_index[_norm_bus(bus)] = i
    nv_links: dict[tuple[int, int], list[int]] = {}
    switch_links: dict[int, tuple[int, int]] = {}  # device -> (links to switches, version)
    for i, h in enumerate(handles):
        for link in range(18):
            if _try(lambda: pynvml.nvmlDeviceGetNvLinkState(h, link)) != 1:
                continue
            version = _try(lambda: pynvml.nvmlDeviceGetNvLinkVersion(h, link)) or 4
            remote_type = _try(lambda: pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
            if remote_type == 2:  # NVML_NVLINK_DEVICE_TYPE_SWITCH
                count, _ = switch_links.get(i, (0, version))
                switch_links[i] = (count + 1, version)
                continue
            remote = _try(lambda: pynvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link).busId)
            j = bus_to_index.get(_norm_bus(remote)) if remote is not None else None
            if j is not None and j > i:
                nv_links.setdefault((i, j), []).append(version)
    for (i, j), versions in nv_links.items():
        rate = sum(nvlink_GBps_per_link(v) for v in versions)
        links.append(Link(i, j, "nvlink", rate, detail=f"{len(versions)} x NVLink{versions[0]}"))
    for i in range(n):
        for j in range(i + 1, n):
            if (i, j) in nv_links:
                continue
            if i in switch_links and j in switch_links:
                (ci, vi), (cj, _) = switch_links[i], switch_links[j]
                rate = min(ci, cj) * nvlink_GBps_per_link(vi)
                links.append(Link(i, j, "nvswitch", rate, detail=f"{min(ci, cj)} x NVLink{vi} via NVSwitch"))
            elif _try(lambda: pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], 0)) == 0:  # READ caps index
                rate = min(links[i].GBps, links[j].GBps)
                links.append(Link(i, j, "pcie", rate, detail="PCIe peer-to-peer"))
    return Topology(tuple(specs), tuple(links + _peer_links_nvml_missed(n, links)), source="nvml")


def _peer_links_nvml_missed(n: int, links: list[Link]) -> list[Link]:
    """A link for each device pair the CUDA runtime can reach directly but NVML reported
    nothing between (some virtual machines hide NVLink from NVML): without it, route
    discovery would see no relay. Priced at the slower of the two host links, a floor; the
    multi-path copier measures real rates as it goes."""
    known = {(min(l.src, l.dst), max(l.src, l.dst)) for l in links if l.src != HOST}
    host_rate = {l.dst: l.GBps for l in links if l.src == HOST}
    out = []
    for i in range(n):
        for j in range(i + 1, n):
            if (i, j) not in known and _try(lambda: torch.cuda.can_device_access_peer(i, j)):
                rate = min(host_rate.get(i, 0.0), host_rate.get(j, 0.0)) or pcie_GBps(4, 16)
                out.append(Link(i, j, "peer", rate, detail="peer access (CUDA runtime); NVML reported no link"))
    return out


def _sysfs_numa(bus: Any) -> int | None:
    """NUMA node of a PCI device from sysfs (older NVML lacks nvmlDeviceGetNumaNodeId)."""
    if bus is None:
        return None
    path = f"/sys/bus/pci/devices/{_norm_bus(bus)}/numa_node"
    try:
        with open(path) as fh:
            node = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _norm_bus(bus: Any) -> str:
    text = bus.decode() if isinstance(bus, bytes) else str(bus)
    return text.lower()[-12:]  # "dddd:bb:dd.f"; NVML pads the domain to 8 digits in some versions


def _try(fn):
    try:
        return fn()
    except Exception:  # NVML raises NotSupported per query on many parts; absence is the answer
        return None
