"""A reusable, exact-size pool of pinned host buffers under a host-memory budget.

Why not ``tensor.pin_memory()``: torch's caching host allocator rounds every block up to a
power of two (a 4.5 GiB tensor takes 8 GiB) and a fresh pinned allocation costs milliseconds
under a global lock. The arena asks the backend for exactly the bytes requested, keeps
released buffers for reuse by the next request of the same size (training asks for the same
sizes every step), and refuses to hold more than its budget.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .errors import HostMemoryBudgetError
from .units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["HostArena", "ArenaStats"]


@dataclass(frozen=True)
class ArenaStats:
    """Arena figures in bytes.

    Attributes:
        in_use: bytes handed out and not yet released.
        cached: bytes released and kept for reuse.
        peak: the most ``in_use + cached`` has been.
        budget: the limit on ``in_use + cached``, or None.
        allocations: raw pinned allocations made (a reuse does not count).
        reuses: requests served from the cache.
    """

    in_use: int
    cached: int
    peak: int
    budget: int | None
    allocations: int
    reuses: int


class HostArena:
    """Pinned host buffers of exact sizes, reused, within a budget.

    Args:
        backend: the backend whose ``alloc_pinned``/``free_pinned`` make raw buffers.
        budget: most bytes the arena may hold (in use plus cached), or None for no limit.
            Accepts ``"64GB"``-style strings.
    """

    def __init__(self, backend: "Backend", budget: int | str | None = None) -> None:
        self._backend = backend
        self.budget = None if budget is None else parse_bytes(budget)
        self._lock = threading.Lock()
        self._in_use: dict[int, torch.Tensor] = {}  # data_ptr -> raw uint8 buffer
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # data_ptr -> raw buffer, oldest first
        self._in_use_bytes = 0
        self._cached_bytes = 0
        self._peak = 0
        self._allocations = 0
        self._reuses = 0

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A pinned, contiguous, uninitialised host tensor; give it back with :meth:`release`.

        Raises:
            HostMemoryBudgetError: the request does not fit the budget even after the cache
                is emptied; nothing is allocated.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = 1
        for dim in shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {shape}")
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = self._take(nbytes)
        return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)

    def release(self, tensor: torch.Tensor) -> None:
        """Return a tensor from :meth:`empty` to the cache. The caller must not use it again.

        Raises:
            ValueError: the tensor did not come from this arena (or was released already).
        """
        self._hand_back(tensor, "release", cache=True)

    def free(self, tensor: torch.Tensor) -> None:
        """Give a tensor from :meth:`empty` back to the backend at once, not to the cache: its
        memory returns to the system when the last view of it goes. The caller must not use it again.

        Raises:
            ValueError: the tensor did not come from this arena (or was released already).
        """
        self._hand_back(tensor, "free", cache=False)

    def _hand_back(self, tensor: torch.Tensor, verb: str, cache: bool) -> None:
        if tensor.numel() == 0:
            return
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            raw = self._in_use.pop(ptr, None)
            if raw is None:
                raise ValueError(f"{verb}() got a tensor this arena did not hand out, or one already released")
            self._in_use_bytes -= raw.numel()
            if cache:
                self._cache[ptr] = raw
                self._cached_bytes += raw.numel()
            else:
                self._backend.free_pinned(raw)

    def trim(self) -> int:
        """Free every cached buffer; return the bytes freed."""
        with self._lock:
            freed = self._evict(self._cached_bytes)
        return freed

    def stats(self) -> ArenaStats:
        """Current figures."""
        with self._lock:
            return ArenaStats(self._in_use_bytes, self._cached_bytes, self._peak, self.budget,
                              self._allocations, self._reuses)

    # ------------------------------------------------------------------ internals
    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for ptr, raw in self._cache.items():
                if raw.numel() == nbytes:
                    del self._cache[ptr]
                    self._cached_bytes -= nbytes
                    self._hand_out(ptr, raw)
                    self._reuses += 1
                    return raw
            if nbytes == 0:
                return torch.empty(0, dtype=torch.uint8)
            if self.budget is not None:
                if nbytes > self.budget - self._in_use_bytes:
                    raise HostMemoryBudgetError(
                        f"pinned host request of {format_bytes(nbytes)} does not fit the host-memory budget: "
                        f"{format_bytes(self._in_use_bytes)} of {format_bytes(self.budget)} is in use; "
                        f"raise XPU_HOST_MEM_BUDGET or release buffers"
                    )
                over = self._in_use_bytes + self._cached_bytes + nbytes - self.budget
                if over > 0:
                    self._evict(over)
            raw = self._backend.alloc_pinned(nbytes)
            self._allocations += 1
            self._hand_out(raw.data_ptr(), raw)
            return raw

    def _hand_out(self, ptr: int, raw: torch.Tensor) -> None:
        self._in_use[ptr] = raw
        self._in_use_bytes += raw.numel()
        self._peak = max(self._peak, self._in_use_bytes + self._cached_bytes)

    def _evict(self, nbytes: int) -> int:
        freed = 0
        while freed < nbytes and self._cache:
            _, raw = self._cache.popitem(last=False)
            freed += raw.numel()
            self._cached_bytes -= raw.numel()
            self._backend.free_pinned(raw)
        return freed
