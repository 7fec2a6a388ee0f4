"""The ``Backend`` interface: the one surface strategies use to reach a device.

About twenty verbs in five groups (DESIGN.md §4):

* identity: ``name``, ``device_type``, ``dist_backend``, ``visible_devices_env``,
  ``caps``, ``device_count``, ``env_for_device_count``, ``device``,
  ``device_scope``, ``current_device``;
* streams and events: ``stream``, ``current_stream``, ``use_stream``, ``event``,
  ``synchronize``, ``keep_alive``;
* host memory: ``alloc_pinned``/``free_pinned`` (exact size), ``host_arena`` (reusable,
  budgeted), ``register_host``/``unregister_host``, ``is_pinned``, ``device_view``;
* copies and device memory: ``empty``, ``free_storage``/``realloc_storage``, ``copy``,
  ``to_device``, ``export_buffer``/``import_buffer``/``unlink_buffer`` (memory other
  processes write), ``can_access_peer``, ``enable_peer_access``;
* memory and topology: ``mem_info``, ``memory_stats``, ``reset_peak_memory``,
  ``reserved_by_stream``, ``set_memory_cap``, ``memory_cap``, ``topology``.

Where torch already abstracts a verb (``torch.accelerator``, ``torch.Stream``,
``torch.Event``) this base class implements it once for every accelerator backend; a backend
file overrides only what its hardware does differently.
"""
from __future__ import annotations

import abc
import contextlib
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch

from .capabilities import Capabilities
from .errors import CapabilityError
from .stream_pools import StreamPool
from .topology import Topology
from .units import env_bytes, parse_bytes

__all__ = ["Backend", "MemoryStats", "BufferHandle", "check_copy_pairs"]


@dataclass(frozen=True)
class MemoryStats:
    """This process's allocator figures for one device, in bytes.

    Attributes:
        allocated: bytes held by live tensors.
        reserved: bytes the allocator holds from the device (allocated plus its cache).
        peak_allocated: the most ``allocated`` has been since the last reset.
        peak_reserved: the most ``reserved`` has been since the last reset.
        alloc_retries: allocations so far that the allocator could only make after freeing its
            cache (a caching allocator at its cap or the device's end: on CUDA it first waits
            for every stream's pending frees, a stall); 0 where not counted.
    """

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    alloc_retries: int = 0


@dataclass(frozen=True)
class BufferHandle:
    """A picklable reference to a device buffer another process can open (``Backend.import_buffer``).

    Attributes:
        owner: index of the device whose memory holds the buffer.
        nbytes: size in bytes.
        kind: how it travels: ``"reduction"`` (torch's IPC tensor reduction, e.g. CUDA IPC) or
            ``"shm"`` (a shared-memory file: the cpu backend's virtual devices).
        payload: what ``kind`` needs to open it (the reduction's rebuild call, a file path).
    """

    owner: int
    nbytes: int
    kind: str
    payload: Any


class Backend(abc.ABC):
    """A device family (CUDA GPUs, Ascend NPUs, or the cpu reference's virtual devices).

    Instances are made by the registry (``xpu.get_backend()``), one per process.
    """

    #: Registry name, the value ``XPU_BACKEND`` takes.
    name: ClassVar[str]
    #: torch device type of device tensors (``"cuda"``, ``"npu"``, ``"cpu"``).
    device_type: ClassVar[str]
    #: torch.distributed backend for collectives between devices of this kind.
    dist_backend: ClassVar[str]
    #: Environment variable that restricts and orders visible devices, if any.
    visible_devices_env: ClassVar[str | None] = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None if this backend can run in this process, else a sentence saying why not.

        Must not initialise devices or change state: the registry calls it while choosing.
        """
        return None

    def __init__(self) -> None:
        self._caps: Capabilities | None = None
        self._arena = None
        self._caps_bytes: dict[int, int] = {}
        # Parsed now, though the arena is made on first use: a bad value is refused before any
        # work starts (``xpu info`` included), not halfway through a run.
        budget = os.environ.get("XPU_HOST_MEM_BUDGET")
        self._host_budget = env_bytes("XPU_HOST_MEM_BUDGET", budget) if budget else None

    # ------------------------------------------------------------------ identity
    @property
    def caps(self) -> Capabilities:
        """What this backend can do here; computed once."""
        if self._caps is None:
            self._caps = self._detect_caps()
        return self._caps

    @abc.abstractmethod
    def _detect_caps(self) -> Capabilities:
        """Work out :attr:`caps` (called once, lazily)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices visible to this process."""

    def env_for_device_count(self, count: int) -> dict[str, str] | None:
        """Environment under which a new process of this backend sees ``count`` devices, made up
        like the existing ones; None where they cannot be made up (hardware devices, or a
        configuration that names each device). Only backends with ``caps.virtual_devices`` can."""
        return None

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` of device ``index`` (the current device if None).

        Raises:
            ValueError: ``index`` is not in ``0..device_count()-1``.
        """
        i = self.current_device() if index is None else self.index_of(index)
        return torch.device(self.device_type, i)

    def index_of(self, device: Any) -> int:
        """Normalise an index, ``torch.device`` or None to a checked device index."""
        if device is None:
            return self.current_device()
        if isinstance(device, torch.device):
            if device.type != self.device_type:
                raise ValueError(f"{device} is not a {self.name} device; expected type '{self.device_type}'")
            device = device.index if device.index is not None else self.current_device()
        if not isinstance(device, int) or isinstance(device, bool):
            raise TypeError(f"expected a device index, torch.device or None, got {device!r}")
        count = self.device_count()
        if not 0 <= device < count:
            raise ValueError(f"device index {device} is out of range: backend '{self.name}' has {count} device(s), 0..{count - 1}")
        return device

    def device_scope(self, index: Any) -> contextlib.AbstractContextManager:
        """Context in which ``index`` is the current device (allocations, kernels, streams)."""
        return torch.accelerator.device_index(self.index_of(index))

    def current_device(self) -> int:
        """Index of the current device."""
        return torch.accelerator.current_device_index()

    def bind_process(self, index: Any) -> None:
        """Make ``index`` this process's current device from now on (a rank process's first call).

        Collective libraries that stage objects on the current device (NCCL's
        ``all_gather_object``, ``barrier``) then use the rank's own device, not device 0.
        Unlike :meth:`device_scope` it is not undone; allocation tracking is unchanged. CUDA and
        NPU keep the current device per host thread: a worker thread that touches the device
        calls it too, or it starts on device 0.
        """
        torch.accelerator.set_device_index(self.index_of(index))

    # ------------------------------------------------------------------ streams and events
    def stream(self, device: Any = None, priority: int = 0) -> torch.Stream:
        """A new stream on ``device``; lower ``priority`` numbers run first, as in CUDA."""
        return torch.Stream(self.device(device), priority=priority)

    def current_stream(self, device: Any = None) -> torch.Stream:
        """The stream work is queued on now for ``device``.

        A backend returns streams and events of one family (all generic, or all its device
        module's own): a generic stream's ``wait_event`` may not see a device-specific
        event's record.
        """
        return torch.accelerator.current_stream(self.index_of(device))

    def use_stream(self, stream: torch.Stream) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current for its device."""
        return stream

    def event(self, timing: bool = False, blocking: bool = False) -> torch.Event:
        """A new event; ``timing=True`` lets ``elapsed_time`` measure between two records.

        ``blocking=True``: a thread in its ``synchronize`` sleeps until it completes, where by
        default the runtime may spin on a core (lower latency, a core busy while it waits).
        """
        return torch.Event(self.device_type, enable_timing=timing, blocking=blocking)

    def synchronize(self, device: Any = None) -> None:
        """Block the host until all work queued on ``device`` has finished."""
        torch.accelerator.synchronize(self.index_of(device))

    def keep_alive(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        """Keep ``tensor``'s memory from reuse until work queued so far on ``stream`` ends."""
        if tensor.device.type == self.device_type:
            tensor.record_stream(stream)

    # ------------------------------------------------------------------ host memory
    @abc.abstractmethod
    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of exactly ``nbytes`` bytes, as a uint8 CPU tensor.

        Fast DMA source/target; device-mapped too where ``caps.dha``. Prefer
        :attr:`host_arena`, which reuses buffers and enforces the host-memory budget; this is
        the raw allocation it builds on. Free with :meth:`free_pinned`.
        """

    def free_pinned(self, buffer: torch.Tensor) -> None:
        """Release a buffer from :meth:`alloc_pinned` (no-op where freeing is automatic)."""

    def register_host(self, tensor: torch.Tensor) -> None:
        """Pin an existing, contiguous host tensor in place (page-locked and device-mapped).

        Raises:
            CapabilityError: ``caps.host_register`` is false.
            ValueError: the tensor is not a contiguous CPU tensor.
        """
        raise CapabilityError(f"backend '{self.name}' cannot register host memory here; use alloc_pinned or host_arena")

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host`; call before the tensor's memory is freed."""
        raise CapabilityError(f"backend '{self.name}' cannot register host memory here")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in pinned (or registered) host memory."""
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def device_view(self, host_tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        """A device tensor aliasing pinned ``host_tensor``: kernels read and write host memory.

        No bytes are copied; each kernel access crosses the host link. The view keeps
        ``host_tensor`` alive.

        Raises:
            CapabilityError: ``caps.dha`` is false.
            ValueError: ``host_tensor`` is not pinned host memory.
        """
        raise CapabilityError(
            f"backend '{self.name}' has no Direct Host Access here (caps.dha is False); "
            f"copy the tensor to the device with copy()/to_device() instead"
        )

    @property
    def host_arena(self):
        """This backend's shared :class:`~xpu.arena.HostArena` (budget from ``XPU_HOST_MEM_BUDGET``)."""
        if self._arena is None:
            from .arena import HostArena

            self._arena = HostArena(self, budget=self._host_budget)
        return self._arena

    # ------------------------------------------------------------------ copies and device memory
    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        """An uninitialised tensor in device memory (counted against the device's cap)."""
        return torch.empty(shape, dtype=dtype, device=self.device(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.Stream | None = None) -> None:
        """Copy ``src`` into ``dst`` (same shape), ordered on ``stream``.

        Host→device, device→host, device→device and peer copies all go through here. The
        copy is asynchronous when the host side is pinned (or both sides are devices); the
        caller records an event on ``stream`` to know when it is done and must keep both
        tensors alive until then (see :meth:`keep_alive`).
        """
        if dst.shape != src.shape:
            raise ValueError(f"copy needs equal shapes, got dst {tuple(dst.shape)} and src {tuple(src.shape)}")
        non_blocking = self._asynchronous((dst, src))
        if stream is None:
            dst.copy_(src, non_blocking=non_blocking)
            return
        with self.use_stream(stream):
            dst.copy_(src, non_blocking=non_blocking)

    def copy_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                  stream: torch.Stream | None = None) -> None:
        """:meth:`copy` of each ``srcs[i]`` into ``dsts[i]``, issued as one call.

        Same ordering, asynchrony and lifetime rules as :meth:`copy`. One ``_foreach_copy_``
        costs the issuing thread far less than a copy per tensor: a block's 12 gradients sent
        home took 145 us of the training thread instead of 526 (H200, 2026-12-04,
        ``bench/scripts/diag_grad_post.py``).

        Raises:
            ValueError: the lists differ in length, or a pair in shape.
        """
        check_copy_pairs(dsts, srcs)
        if not dsts:
            return
        non_blocking = self._asynchronous((*dsts, *srcs))
        with self.use_stream(stream) if stream is not None else contextlib.nullcontext():
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)

    def _asynchronous(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a copy among ``tensors`` may be non-blocking: each host one is pinned."""
        return all(t.device.type != "cpu" or self.is_pinned(t) for t in tensors)

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Give back ``tensor``'s device memory but keep the tensor (and every view of it).

        The tensor's shape and the views' metadata stay valid, so autograd's saved references
        and ``nn.Parameter`` objects survive; reading it before :meth:`realloc_storage` is an
        error. Call :meth:`keep_alive` first for streams still using the memory.
        """
        tensor.untyped_storage().resize_(0)

    def realloc_storage(self, tensor: torch.Tensor, device: Any = None) -> None:
        """Give a tensor emptied by :meth:`free_storage` fresh (uninitialised) device memory.

        Memory comes from the current stream's pool; every view of the tensor sees it.
        """
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())

    def to_device(self, tensor: torch.Tensor, device: Any = None, stream: torch.Stream | None = None) -> torch.Tensor:
        """A copy of ``tensor`` in device memory (see :meth:`copy` for ordering)."""
        out = self.empty(tensor.shape, tensor.dtype, device)
        self.copy(out, tensor, stream)
        return out

    def export_buffer(self, nbytes: int, device: Any = None) -> tuple[torch.Tensor, BufferHandle]:
        """Allocate ``nbytes`` on ``device`` (counted against it) and a handle that other
        processes open with :meth:`import_buffer` and write one-sidedly (peer pools).

        Raises:
            ValueError: ``nbytes`` is not a positive integer.
            CapabilityError: ``caps.ipc`` is false.
        """
        index = self._check_export(nbytes, device)
        from torch.multiprocessing.reductions import reduce_tensor

        with self.device_scope(index):
            buf = self.empty(nbytes, torch.uint8, index)
        return buf, BufferHandle(index, nbytes, "reduction", reduce_tensor(buf))

    def import_buffer(self, handle: BufferHandle) -> torch.Tensor:
        """Open a buffer another process exported; the result aliases the owner's memory."""
        if handle.kind != "reduction":
            raise ValueError(f"backend '{self.name}' cannot open a buffer handle of kind {handle.kind!r}")
        rebuild, args = handle.payload
        return rebuild(*args)

    def unlink_buffer(self, handle: BufferHandle) -> None:
        """Drop an exported buffer's name once every process has opened it (memory stays mapped)."""

    def _check_export(self, nbytes: int, device: Any) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"export_buffer needs a positive byte count, got {nbytes!r}")
        index = self.index_of(device)
        if not self.caps.ipc:
            raise CapabilityError(f"backend '{self.name}' cannot share device memory between processes (caps.ipc is False)")
        return index

    def can_access_peer(self, a: Any, b: Any) -> bool:
        """Whether device ``a`` can read and write device ``b``'s memory directly."""
        return False

    def enable_peer_access(self, a: Any, b: Any) -> bool:
        """Enable direct access between ``a`` and ``b`` (both ways); return whether it holds."""
        return self.can_access_peer(a, b)

    # ------------------------------------------------------------------ memory and topology
    @abc.abstractmethod
    def _raw_mem_info(self, index: int) -> tuple[int, int]:
        """Device-wide (free, total) bytes, before any cap."""

    def mem_info(self, device: Any = None) -> tuple[int, int]:
        """``(free, total)`` bytes of ``device``; under a cap, total is the cap and free what is left of it."""
        index = self.index_of(device)
        free, total = self._raw_mem_info(index)
        cap = self._caps_bytes.get(index)
        if cap is None:
            return free, total
        return max(0, min(free, cap - self.memory_stats(index).reserved)), cap

    def memory_stats(self, device: Any = None) -> MemoryStats:
        """This process's allocator figures for ``device``."""
        i = self.index_of(device)
        mem = torch.accelerator.memory
        retries = mem.memory_stats(i).get("num_alloc_retries", 0) if hasattr(mem, "memory_stats") else 0
        return MemoryStats(mem.memory_allocated(i), mem.memory_reserved(i),
                           mem.max_memory_allocated(i), mem.max_memory_reserved(i), int(retries))

    def reset_peak_memory(self, device: Any = None) -> None:
        """Start the peaks of :meth:`memory_stats` afresh."""
        torch.accelerator.memory.reset_peak_memory_stats(self.index_of(device))

    def reserved_by_stream(self, device: Any = None,
                           streams: Mapping[str, Any] | None = None) -> dict[str, StreamPool]:
        """``device``'s reserved bytes split by the stream whose allocator pool holds them, largest
        first (:mod:`xpu.stream_pools`), streams in ``streams`` named by their keys. Empty where
        the allocator does not say (the base)."""
        self.index_of(device)
        return {}

    def release_cache(self, device: Any = None) -> None:
        """Give the allocator's cached, unused blocks on ``device`` back to the device: reserved
        bytes fall to what is in use, so a peak of reserved memory measured from here (after
        :meth:`reset_peak_memory`) counts only what is reserved from here on."""
        with self.device_scope(device):
            torch.accelerator.memory.empty_cache()

    def avoid_fragmentation(self) -> bool:
        """Ask the device allocator to grow segments in place rather than cache fixed blocks
        (CUDA's ``expandable_segments``), so reserved memory stays close to allocated memory
        and a cap on reserved bytes (:meth:`set_memory_cap`) binds on what is in use; applies to
        segments allocated from now on. Leaves a setting the user made in the environment as it
        is. Returns whether the allocator now works that way; the base: no such setting (False).
        """
        return False

    def set_memory_cap(self, device: Any, nbytes: int | str | None) -> None:
        """Limit this process to ``nbytes`` of ``device``'s memory (None lifts the cap).

        Allocations past the cap raise ``torch.OutOfMemoryError``, as on a smaller device.

        Raises:
            ValueError: the cap is larger than the device or not positive.
        """
        index = self.index_of(device)
        if nbytes is None:
            self._caps_bytes.pop(index, None)
            self._apply_memory_cap(index, None)
            return
        nbytes = parse_bytes(nbytes)
        total = self._raw_mem_info(index)[1]
        if not 0 < nbytes <= total:
            raise ValueError(f"memory cap {nbytes} B for device {index} must be positive and at most the device's {total} B")
        self._apply_memory_cap(index, nbytes)
        self._caps_bytes[index] = nbytes

    @abc.abstractmethod
    def _apply_memory_cap(self, index: int, nbytes: int | None) -> None:
        """Make the allocator of device ``index`` enforce ``nbytes`` (None: no cap)."""

    def memory_cap(self, device: Any = None) -> int | None:
        """The cap set by :meth:`set_memory_cap`, or None."""
        return self._caps_bytes.get(self.index_of(device))

    def cap_overshoot(self, device: Any = None) -> int:
        """Bytes by which the allocator's reserved memory may pass a cap set by
        :meth:`set_memory_cap` (0: the cap is exact), so a caller that must stay under a figure
        caps this much below it."""
        self.index_of(device)
        return 0

    @abc.abstractmethod
    def topology(self) -> Topology:
        """Devices, host links and peer links with kinds and nominal rates."""

    # ------------------------------------------------------------------ misc
    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary used by ``xpu info``."""
        return {
            "backend": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "visible_devices": os.environ.get(self.visible_devices_env) if self.visible_devices_env else None,
            "device_count": self.device_count(),
            "caps": self.caps.as_dict(),
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} devices={self.device_count()}>"


def check_copy_pairs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``dsts`` and ``srcs`` pair up one to one with equal shapes
    (:meth:`Backend.copy_many`'s arguments; checked before anything is copied)."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many needs as many sources as targets, got {len(srcs)} and {len(dsts)}")
    for i, (dst, src) in enumerate(zip(dsts, srcs)):
        if dst.shape != src.shape:
            raise ValueError(f"copy_many needs equal shapes, pair {i} has dst {tuple(dst.shape)} and src {tuple(src.shape)}")
