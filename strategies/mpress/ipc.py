"""Peer pools: device buffers one process allocates and others write one-sidedly.

The peer that owns spare memory allocates a buffer on its own device at start-up (so the bytes
count against *its* budget) with ``Backend.export_buffer``; the stage processes that swap into
it open the handle with ``Backend.import_buffer`` and copy into their own region of it without
the owner taking part. How the buffer travels (CUDA IPC, a shared-memory file for the cpu
backend's virtual devices) is the backend's business. This module adds the region allocator
each writer uses inside its part of a pool.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from xpu import BufferHandle

__all__ = ["BufferHandle", "export_buffer", "import_buffer", "unlink_buffer", "RegionAllocator", "ipc_supported"]

_ALIGN = 64


def ipc_supported(backend: Any) -> bool:
    """Whether buffers on this backend's devices can be opened by other processes."""
    return bool(backend.caps.ipc)


def export_buffer(backend: Any, nbytes: int, device: int) -> tuple[torch.Tensor, BufferHandle]:
    """``backend.export_buffer(nbytes, device)``: a pool counted against ``device`` and its handle."""
    return backend.export_buffer(nbytes, device)


def import_buffer(backend: Any, handle: BufferHandle) -> torch.Tensor:
    """``backend.import_buffer(handle)``: the owner's memory, mapped here."""
    return backend.import_buffer(handle)


def unlink_buffer(backend: Any, handle: BufferHandle) -> None:
    """``backend.unlink_buffer(handle)``, once every process has opened it."""
    backend.unlink_buffer(handle)


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
