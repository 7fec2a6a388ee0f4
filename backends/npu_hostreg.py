"""The host page spans an NPU backend registered with ``npuHostRegister``, and their undoing.

Status: NOT RUN ON ASCEND HARDWARE (see :mod:`backends.npu`). Checked against the recording
stand-in ``tests/fake_torch_npu.py``: 4 KiB-aligned start, size padded to 4 KiB, flag
``ACL_HOST_REG_MAPPED`` (0x2), return codes checked, unregistration on release and on
garbage collection, refusal of page spans that partly overlap an earlier registration.

Unverified: that ``npuHostRegister``/``npuHostUnregister``, which bypass torch_npu's task
queue (``TASK_QUEUE_ENABLE``), are safely ordered with copies queued through it; callers
must release memory only after the copies using it completed.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from xpu.errors import XpuError

__all__ = ["ACL_HOST_REG_MAPPED", "HOST_REGISTER_ALIGN", "page_span", "HostRegistrations"]

#: ``aclrtHostRegisterV2`` flag: page-lock the range and map it into the device's address
#: space. MAPPED rather than PINNED because DeepSpeed measured PINNED-only registrations of
#: 64 MiB falling back to about 8-9 GB/s H2D on a 910B4, against about 23 GB/s for MAPPED.
ACL_HOST_REG_MAPPED = 0x2
#: CANN requires MAPPED registrations to start on a 4 KiB boundary.
HOST_REGISTER_ALIGN = 4096
_ACL_SUCCESS = 0


def page_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 4 KiB-aligned ``(start, size)`` covering ``[ptr, ptr + nbytes)``.

    The address is rounded down and the end up, as DeepSpeed's NativePinnedMemory does for
    ``aclrtHostRegisterV2`` (PR #8532): the registration then covers whole pages, which may
    include bytes of neighbouring allocations in the first and last page.
    """
    start = ptr - ptr % HOST_REGISTER_ALIGN
    end = -(-(ptr + nbytes) // HOST_REGISTER_ALIGN) * HOST_REGISTER_ALIGN
    return start, end - start


@dataclass
class _Registration:
    """One ``npuHostRegister`` call that must be undone."""

    start: int
    size: int
    npurt: Any  # the runtime module that registered it, which must also unregister it
    owner: Any = None  # an mmap the backend allocated; dropped only after unregistering
    finalizer: weakref.finalize | None = None


class HostRegistrations:
    """A thread-safe table of registered page spans, keyed by start and by tensor.

    Each registration is undone by :meth:`release` or, failing that, when the registered
    tensor's storage is garbage-collected.
    """

    def __init__(self) -> None:
        # Re-entrant: a storage's finalizer (which unregisters) can run on this thread at any
        # point where an object is freed, including while the lock is held.
        self._lock = threading.RLock()
        self._by_start: dict[int, _Registration] = {}
        self._starts: list[int] = []  # sorted keys of _by_start, for range lookups
        self._by_tensor: dict[tuple[int, int], int] = {}  # (data_ptr, nbytes) -> start

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether one registration's span contains ``[ptr, ptr + nbytes)``."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return False
            reg = self._by_start[self._starts[i]]
            return ptr + nbytes <= reg.start + reg.size

    def register(self, tensor: torch.Tensor, npurt: Any, owner: Any = None) -> None:
        """Register ``tensor``'s page span with MAPPED through ``npurt`` and arrange its undoing.

        Args:
            tensor: a contiguous, non-empty host tensor.
            npurt: ``torch.npu.npurt()``, which also unregisters it later.
            owner: kept alive until the span is unregistered (the mmap behind ``tensor``).

        Raises:
            ValueError: the span partly overlaps an earlier registration.
            XpuError: ``npuHostRegister`` returned an error code.
        """
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        start, size = page_span(ptr, nbytes)
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            for j in (i - 1, i):
                if 0 <= j < len(self._starts):
                    other = self._by_start[self._starts[j]]
                    if other.start < start + size and start < other.start + other.size:
                        raise ValueError(
                            f"host span [{start:#x}, {start + size:#x}) of this tensor overlaps an earlier registration "
                            f"[{other.start:#x}, {other.start + other.size:#x}): tensors sharing a 4 KiB page cannot be "
                            f"registered separately; register the buffer that holds them both, once"
                        )
            rc = int(npurt.npuHostRegister(start, size, ACL_HOST_REG_MAPPED))
            if rc != _ACL_SUCCESS:
                raise XpuError(
                    f"npuHostRegister({size} B, ACL_HOST_REG_MAPPED) failed with ACL error {rc}; likely causes: a host kernel "
                    f"<= 5.10 (CANN then accepts only aclrtMallocHost memory), a driver/CANN without aclrtHostRegisterV2, "
                    f"or the memlock limit (ulimit -l)"
                )
            reg = _Registration(start, size, npurt, owner)
            self._by_start[start] = reg
            bisect.insort(self._starts, start)
            self._by_tensor[(ptr, nbytes)] = start
        # Unregister before the pages can return to the system allocator; the finalizer
        # fires when the last view of the storage dies (an mmap owner is held until then).
        reg.finalizer = weakref.finalize(tensor.untyped_storage(), self._unregister, start, (ptr, nbytes))
        # At interpreter exit the process lets go of its pages anyway, and torch_npu's runtime
        # may already be torn down; do not call into it then.
        reg.finalizer.atexit = False

    def release(self, ptr: int, nbytes: int) -> None:
        """Unregister the registration made for exactly ``(ptr, nbytes)`` now, if any.

        Raises:
            XpuError: ``npuHostUnregister`` failed; the finalizer stays armed, so a retry
                (or the garbage collector) can still undo the registration.
        """
        with self._lock:
            start = self._by_tensor.get((ptr, nbytes))
            reg = self._by_start.get(start) if start is not None else None
        if reg is None:
            return
        self._unregister(reg.start, (ptr, nbytes))
        if reg.finalizer is not None:
            reg.finalizer.detach()

    def _unregister(self, start: int, key: tuple[int, int]) -> None:
        """``npuHostUnregister`` one registration and forget it (its mmap may then be unmapped)."""
        with self._lock:
            reg = self._by_start.get(start)
            if reg is None:
                return
            rc = int(reg.npurt.npuHostUnregister(start))
            if rc != _ACL_SUCCESS:
                # Keep the record (and any mmap owner) so these pages are not handed back to the
                # system while the driver still holds them.
                raise XpuError(f"npuHostUnregister({start:#x}) failed with ACL error {rc}; the pages stay registered")
            del self._by_start[start]
            self._starts.remove(start)
            self._by_tensor.pop(key, None)
            reg.owner = None
