"""The cpu reference backend: virtual devices with memory capacities, on host memory.

Every strategy runs and is tested on it in CI, where there is no accelerator. A virtual
device is a slice of host memory with a capacity: tensors created while it is current
(``with backend.device_scope(i)``) or by ``empty``/``to_device`` are counted against it until
they are freed, and an allocation past the capacity raises ``torch.OutOfMemoryError``, as a
real device would. Copies between virtual devices and the host are real copies (synchronous).
Streams run work immediately; events record wall-clock time.

Configuration (environment):
    ``XPU_CPU_DEVICES``     number of virtual devices (default 4)
    ``XPU_CPU_DEVICE_MEM``  capacity of each, e.g. ``2GB`` (default), or a comma list per device
    ``XPU_CPU_HOST_GBPS``   declared host-link rate per device (default 25)
    ``XPU_CPU_PEER_GBPS``   declared peer-link rate between devices (default 100; 0: no peers)
    ``XPU_CPU_TOPOLOGY``    a topology preset name (``dgx-h100``...) or a JSON file; replaces
                            the declared links (and sets the device count and capacities)
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import uuid
import time
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xpu.backend import Backend, BufferHandle, MemoryStats
from xpu.capabilities import Capabilities
from xpu.errors import DeviceOutOfMemoryError, EnvSettingError
from xpu.topology import Topology, preset
from xpu.units import env_bytes, env_int, format_bytes, parse_bytes

__all__ = ["CpuBackend", "CpuStream", "CpuEvent"]


class CpuEvent:
    """An event on the cpu backend: work is synchronous, so recording notes the time."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: "CpuStream | None" = None) -> None:
        """Mark this point (all earlier work is already done)."""
        self._t = time.perf_counter()

    def query(self) -> bool:
        """Always True: nothing runs asynchronously."""
        return True

    def synchronize(self) -> None:
        """No-op: nothing runs asynchronously."""

    def wait(self, stream: "CpuStream | None" = None) -> None:
        """No-op: nothing runs asynchronously."""

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds from this event's record to ``end``'s."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end._t - self._t) * 1e3


class CpuStream:
    """A stream on the cpu backend: work queued on it runs immediately."""

    def __init__(self, device_index: int, priority: int = 0) -> None:
        self.device_index = device_index
        self.priority = priority

    def wait_event(self, event: CpuEvent) -> None:
        """No-op: the event's work is done."""

    def wait_stream(self, stream: "CpuStream") -> None:
        """No-op: the other stream's work is done."""

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        """Record (and return) an event on this stream."""
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        """Always True."""
        return True

    def synchronize(self) -> None:
        """No-op."""

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"CpuStream(device={self.device_index}, priority={self.priority})"


class _Device:
    """Accounting for one virtual device."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.limit = capacity  # capacity, or a smaller cap
        self.allocated = 0
        self.peak = 0


class _Tracker(TorchDispatchMode):
    """Attributes storages created by ops to the current virtual device."""

    def __init__(self, backend: "CpuBackend") -> None:
        super().__init__()
        self.backend = backend

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: ``torch.compile`` compiles under the tracker. A mode that says False makes dynamo
        skip every frame, silently ("non-infra torch dispatch mode present"), so compiled blocks
        ran eagerly on this backend (session 56). The compiled code's buffers still reach the
        tracker: :func:`_route_compiled_buffers`."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        device = self.backend._current()
        if device is None or self.backend._untracked_depth():
            return out
        made = [t for t in _tensors(out) if t.device.type == "cpu"]
        if made:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) + (_tensors(kwargs) if kwargs else [])}
            for t in made:
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    self.backend._track(storage, device)
        return out


def _route_compiled_buffers() -> None:
    """Send the buffers Inductor's generated cpu code allocates through ``torch.empty_strided``.

    Its fast path (``torch._C._dynamo.guards._empty_strided_cpu``, read when a compiled module
    loads) skips the dispatcher, so a compiled block's activations would count against no virtual
    device: a plan priced them at nothing (with it, a compiled GPT block saves and peaks as its
    eager self does). About 2 us more a buffer; for every cpu compile in the process, once set.
    """
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fast = getattr(guards, "_empty_strided_cpu", None)
    if fast is None or getattr(fast, "_xpu_routed", False):
        return

    def empty_strided_cpu(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    empty_strided_cpu._xpu_routed = True  # type: ignore[attr-defined]
    guards._empty_strided_cpu = empty_strided_cpu


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested lists, tuples and dicts): what
    ``torch.utils._pytree.tree_flatten`` finds there, at a fraction of its cost on every op
    (profiled, two memferry test files spent 28 of their 77 s flattening; they run 1.25x faster)."""
    if isinstance(tree, torch.Tensor):  # most ops' result
        return [tree]
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found


class CpuBackend(Backend):
    """Virtual devices on host memory; see the module docstring for configuration."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    def __init__(self) -> None:
        super().__init__()
        self._topology = self._build_topology()
        self._devices = [_Device(d.total_bytes) for d in self._topology.devices]
        self._live: dict[int, list] = {}  # storage data_ptr -> record [device, ptr, nbytes]
        self._records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> record
        self._pinned: set[int] = set()  # data_ptrs of pinned/registered host storages
        # Reentrant: garbage collection can run a dead storage's _untrack finalizer inside
        # _track (weakref.finalize allocates) on the same thread, which a plain Lock deadlocks on.
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._default_streams = [CpuStream(i) for i in range(len(self._devices))]
        _route_compiled_buffers()  # compiled code's buffers counted like any op's

    # ------------------------------------------------------------------ configuration
    @staticmethod
    def _build_topology() -> Topology:
        chosen = os.environ.get("XPU_CPU_TOPOLOGY")
        if chosen:
            if os.path.exists(chosen):
                with open(chosen) as fh:
                    return Topology.from_json(fh.read())
            count = env_int("XPU_CPU_DEVICES", os.environ.get("XPU_CPU_DEVICES", "8"), least=1)
            return preset(chosen, count)
        count = env_int("XPU_CPU_DEVICES", os.environ.get("XPU_CPU_DEVICES", "4"), least=1)
        # The whole value is named in the error (not one item of a comma list): that is what the user typed.
        raw = os.environ.get("XPU_CPU_DEVICE_MEM", "2GB")
        try:
            mems = [parse_bytes(m) for m in raw.split(",")]
        except ValueError:
            env_bytes("XPU_CPU_DEVICE_MEM", raw, also=" (or a comma list, one per device)")  # raises, naming it
            raise
        if len(mems) == 1:
            mems *= count
        if len(mems) != count:
            raise EnvSettingError(f"XPU_CPU_DEVICE_MEM lists {len(mems)} capacities for {count} devices; give one or {count}")
        host = float(os.environ.get("XPU_CPU_HOST_GBPS", "25"))
        peer = float(os.environ.get("XPU_CPU_PEER_GBPS", "100"))
        topo = Topology.uniform(count, device_bytes=mems[0], host=("virtual", host),
                                peer=("virtual", peer) if peer > 0 and count > 1 else None,
                                device_name="cpu virtual device", source="declared")
        if len(set(mems)) > 1:
            from xpu.topology import DeviceSpec

            devices = tuple(DeviceSpec(i, "cpu virtual device", m) for i, m in enumerate(mems))
            topo = Topology(devices, topo.links, topo.host_mem_GBps, topo.source)
        return topo

    def _detect_caps(self) -> Capabilities:
        return Capabilities(dha=True, virtual_devices=True, peer_access=any(not l.is_host_link for l in self._topology.links),
                            ipc=True, async_copy=False, host_register=True, timing_events=True)

    # ------------------------------------------------------------------ identity
    def device_count(self) -> int:
        return len(self._devices)

    def env_for_device_count(self, count: int) -> dict[str, str] | None:
        """``XPU_CPU_DEVICES=count``, unless ``XPU_CPU_TOPOLOGY`` or a comma list of capacities in
        ``XPU_CPU_DEVICE_MEM`` names each device (then more of them cannot be made up: None)."""
        if "XPU_CPU_TOPOLOGY" in os.environ or "," in os.environ.get("XPU_CPU_DEVICE_MEM", ""):
            return None
        return {"XPU_CPU_DEVICES": str(count)}

    def device(self, index: int | None = None) -> torch.device:
        """Always ``torch.device("cpu")``: virtual devices share host memory; the backend knows which is which."""
        if index is not None:
            self.index_of(index)
        return torch.device("cpu")

    def index_of(self, device: Any) -> int:
        if isinstance(device, torch.device) and device.type == "cpu":
            return self.current_device()
        return super().index_of(device)

    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
            self._tls.untracked = 0
        return self._tls.stack

    def _current(self) -> int | None:
        stack = self._stack()
        return stack[-1] if stack else None

    def _untracked_depth(self) -> int:
        self._stack()
        return self._tls.untracked

    def current_device(self) -> int:
        current = self._current()
        return 0 if current is None else current

    def bind_process(self, index: Any) -> None:
        """Check ``index``; nothing else: virtual devices are scoped per thread, and gloo stages on the host."""
        self.index_of(index)

    @contextlib.contextmanager
    def device_scope(self, index: Any) -> Iterator[None]:
        """Make virtual device ``index`` current: tensors created inside count against it."""
        i = self.index_of(index)
        stack = self._stack()
        stack.append(i)
        try:
            if len(stack) == 1:
                with _Tracker(self):
                    yield
            else:
                yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def host_scope(self) -> Iterator[None]:
        """Inside a device scope, make tensors created here host memory (not counted)."""
        self._stack()
        self._tls.untracked += 1
        try:
            yield
        finally:
            self._tls.untracked -= 1

    def device_of(self, tensor: torch.Tensor) -> int | None:
        """The virtual device holding ``tensor``'s memory, or None for host memory."""
        entry = self._live.get(tensor.untyped_storage().data_ptr())
        return None if entry is None else entry[0]

    # ------------------------------------------------------------------ accounting
    def _track(self, storage: torch.UntypedStorage, device: int) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or nbytes == 0:
            return
        with self._lock:
            if ptr in self._live:
                return
            dev = self._devices[device]
            if dev.allocated + nbytes > dev.limit:
                raise self._oom(device, nbytes)
            dev.allocated += nbytes
            dev.peak = max(dev.peak, dev.allocated)
            record = self._records.get(storage)
            if record is None:
                # One record per storage object, so a storage freed and reallocated in place
                # (free_storage/realloc_storage) is followed, and its death untracks it once.
                record = self._records[storage] = [device, 0, 0]
                weakref.finalize(storage, self._untrack, record)
            record[:] = [device, ptr, nbytes]
            self._live[ptr] = record

    def _oom(self, index: int, nbytes: int) -> DeviceOutOfMemoryError:
        dev = self._devices[index]
        return DeviceOutOfMemoryError(
            f"cpu virtual device {index} is out of memory: tried to allocate {format_bytes(nbytes)} with "
            f"{format_bytes(dev.allocated)} of {format_bytes(dev.limit)} in use"
        )

    def _untrack(self, record: list) -> None:
        with self._lock:
            device, ptr, nbytes = record
            if nbytes and self._live.get(ptr) is record:
                del self._live[ptr]
                self._devices[device].allocated -= nbytes
            record[1:] = [0, 0]

    # ------------------------------------------------------------------ streams and events
    def stream(self, device: Any = None, priority: int = 0) -> CpuStream:
        return CpuStream(self.index_of(device), priority)

    def current_stream(self, device: Any = None) -> CpuStream:
        return self._default_streams[self.index_of(device)]

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    def event(self, timing: bool = False, blocking: bool = False) -> CpuEvent:
        """A :class:`CpuEvent` (``blocking`` changes nothing: nothing is ever waited for)."""
        return CpuEvent(enable_timing=timing)

    def synchronize(self, device: Any = None) -> None:
        self.index_of(device)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """No-op: cpu work is synchronous, so memory is never reused under a pending copy."""

    # ------------------------------------------------------------------ host memory
    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        with self.host_scope():
            buf = torch.empty(int(nbytes), dtype=torch.uint8)
        self.register_host(buf)
        return buf

    def free_pinned(self, buffer: torch.Tensor) -> None:
        self._pinned.discard(buffer.untyped_storage().data_ptr())

    def register_host(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous host tensor")
        if self.device_of(tensor) is not None:
            raise ValueError(f"register_host got memory of virtual device {self.device_of(tensor)}, not host memory")
        ptr = tensor.untyped_storage().data_ptr()
        self._pinned.add(ptr)
        weakref.finalize(tensor.untyped_storage(), self._pinned.discard, ptr)

    def unregister_host(self, tensor: torch.Tensor) -> None:
        self._pinned.discard(tensor.untyped_storage().data_ptr())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._pinned

    def device_view(self, host_tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        """The host tensor itself: a virtual device reads host memory directly."""
        self.index_of(device)
        if not self.is_pinned(host_tensor):
            raise ValueError("device_view needs pinned host memory; allocate it from host_arena or register_host it first")
        return host_tensor.view(host_tensor.shape)

    # ------------------------------------------------------------------ copies and device memory
    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        index = self.index_of(device)
        with self.host_scope():
            out = torch.empty(shape, dtype=dtype)
        self._track(out.untyped_storage(), index)
        return out

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"copy needs equal shapes, got dst {tuple(dst.shape)} and src {tuple(src.shape)}")
        with self.host_scope():
            dst.copy_(src)

    def copy_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any = None) -> None:
        with self.host_scope():
            super().copy_many(dsts, srcs, stream)

    def free_storage(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        record = self._records.get(storage)
        if record is not None:
            self._untrack(record)
        storage.resize_(0)

    def realloc_storage(self, tensor: torch.Tensor, device: Any = None) -> None:
        index = self.index_of(device)
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        dev = self._devices[index]
        if dev.allocated + nbytes > dev.limit:  # refuse before touching the storage
            raise self._oom(index, nbytes)
        with self.host_scope():
            storage.resize_(nbytes)
        self._track(storage, index)

    def export_buffer(self, nbytes: int, device: Any = None) -> tuple[torch.Tensor, BufferHandle]:
        """A shared-memory file mapped inside the owner's device scope, so the bytes count
        against the owner's virtual device (and not again where other processes map it)."""
        index = self._check_export(nbytes, device)
        path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                            f"xpu-buffer-{os.getpid()}-{uuid.uuid4().hex}")
        with self.device_scope(index):
            buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return buf, BufferHandle(index, nbytes, "shm", path)

    def import_buffer(self, handle: BufferHandle) -> torch.Tensor:
        if handle.kind != "shm":
            return super().import_buffer(handle)
        with self.host_scope():  # the owner already counts these bytes
            return torch.from_file(handle.payload, shared=True, size=handle.nbytes, dtype=torch.uint8)

    def unlink_buffer(self, handle: BufferHandle) -> None:
        if handle.kind == "shm":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle.payload)

    def can_access_peer(self, a: Any, b: Any) -> bool:
        return self._topology.peer_link(self.index_of(a), self.index_of(b)) is not None

    # ------------------------------------------------------------------ memory and topology
    def _raw_mem_info(self, index: int) -> tuple[int, int]:
        dev = self._devices[index]
        return dev.capacity - dev.allocated, dev.capacity

    def memory_stats(self, device: Any = None) -> MemoryStats:
        dev = self._devices[self.index_of(device)]
        return MemoryStats(dev.allocated, dev.allocated, dev.peak, dev.peak)

    def reset_peak_memory(self, device: Any = None) -> None:
        dev = self._devices[self.index_of(device)]
        dev.peak = dev.allocated

    def release_cache(self, device: Any = None) -> None:
        self.index_of(device)  # a virtual device reserves what it allocates: no cache to give back

    def _apply_memory_cap(self, index: int, nbytes: int | None) -> None:
        dev = self._devices[index]
        dev.limit = dev.capacity if nbytes is None else nbytes

    def topology(self) -> Topology:
        return self._topology
