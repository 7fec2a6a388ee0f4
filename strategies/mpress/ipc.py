"""Device buffers allocated by one process and written one-sidedly by others (peer pools).

The peer that owns spare memory allocates a buffer on its own device at start-up (so the
bytes count against *its* budget), exports a picklable handle, and the stage processes that
swap into it import the handle and copy into their region without the owner taking part.

Two transports, chosen by what device memory is:

* device memory that *is* host memory (the cpu backend's virtual devices): a file in
  ``/dev/shm`` mapped with ``torch.from_file(shared=True)``. The owner maps it inside
  ``backend.device_scope(owner)``, so the backend counts it against the owner's virtual
  device; importers map it outside any device scope, so it is not counted twice.
* accelerator memory, where ``caps.ipc``: torch's own tensor reductions
  (``torch.multiprocessing.reductions.reduce_tensor``), i.e. CUDA IPC memory handles.
  Not exercised on a single-GPU machine yet.

This belongs in the Backend (``export_buffer``/``import_buffer`` verbs); see the report.
"""
from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BufferHandle", "export_buffer", "import_buffer", "unlink_buffer", "RegionAllocator", "ipc_supported"]

_ALIGN = 64


@dataclass(frozen=True)
class BufferHandle:
    """A picklable reference to an exported buffer.

    Attributes:
        owner: device index of the owner (the device whose memory holds the buffer).
        nbytes: size in bytes.
        kind: ``"shm"`` (a shared-memory file) or ``"reduction"`` (torch IPC reduction).
        payload: the file path, or the ``(rebuild_fn, args)`` pair of the reduction.
    """

    owner: int
    nbytes: int
    kind: str
    payload: Any


def _device_memory_is_host(backend: Any) -> bool:
    # Virtual devices are slices of host memory: the shared-memory file *is* device memory.
    return backend.device(None).type == "cpu"


def ipc_supported(backend: Any) -> bool:
    """Whether buffers on this backend's devices can be opened by other processes."""
    return bool(backend.caps.ipc)


def export_buffer(backend: Any, nbytes: int, device: int) -> tuple[torch.Tensor, BufferHandle]:
    """Allocate ``nbytes`` on ``device`` (counted against it) and a handle other processes can open.

    Raises:
        ValueError: ``nbytes`` is not positive.
        xpu.CapabilityError: ``caps.ipc`` is false here.
    """
    from xpu.errors import CapabilityError

    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"export_buffer needs a positive byte count, got {nbytes!r}")
    index = backend.index_of(device)
    if not ipc_supported(backend):
        raise CapabilityError(f"backend '{backend.name}' cannot share device memory between processes (caps.ipc is False)")
    if _device_memory_is_host(backend):
        path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"mpress-{os.getpid()}-{uuid.uuid4().hex}")
        with backend.device_scope(index):
            buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return buf, BufferHandle(index, nbytes, "shm", path)
    from torch.multiprocessing.reductions import reduce_tensor

    with backend.device_scope(index):
        buf = backend.empty(nbytes, torch.uint8, index)
    return buf, BufferHandle(index, nbytes, "reduction", reduce_tensor(buf))


def import_buffer(backend: Any, handle: BufferHandle) -> torch.Tensor:
    """Open a buffer exported by another process; the result aliases the owner's memory."""
    if handle.kind == "shm":
        # Outside any device scope on purpose: the owner already counts these bytes.
        with backend.host_scope() if hasattr(backend, "host_scope") else _null():
            return torch.from_file(handle.payload, shared=True, size=handle.nbytes, dtype=torch.uint8)
    if handle.kind == "reduction":
        rebuild, args = handle.payload
        return rebuild(*args)
    raise ValueError(f"unknown buffer handle kind {handle.kind!r}")


def unlink_buffer(handle: BufferHandle) -> None:
    """Remove the name of a shared-memory buffer once every process has opened it (mappings stay valid)."""
    if handle.kind == "shm":
        try:
            os.unlink(handle.payload)
        except FileNotFoundError:
            pass


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class RegionAllocator:
    """First-fit allocator of aligned byte ranges inside one buffer (a writer's peer region).

    Only the writing process allocates in its region, so no cross-process lock is needed.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"region size must be non-negative, got {nbytes}")
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, size), sorted
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0

    def alloc(self, size: int) -> int | None:
        """Offset of a free range of ``size`` bytes (aligned), or None if none fits."""
        need = max(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= need:
                    if free == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, free - need)
                    self.in_use += need
                    self.peak = max(self.peak, self.in_use)
                    return off
        return None

    def free(self, offset: int, size: int) -> None:
        """Return a range from :meth:`alloc` (same ``size``); neighbours are merged."""
        need = max(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
        with self._lock:
            self.in_use -= need
            self._free.append((offset, need))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    @staticmethod
    def footprint(size: int) -> int:
        """Bytes one allocation of ``size`` takes (alignment included): for sizing regions."""
        return max(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
