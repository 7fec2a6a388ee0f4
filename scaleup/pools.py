"""Bounded pools of staging buffers (on a peer device, or pinned host memory).

A pool never holds more than ``max_slots`` buffers of ``slot_bytes``: an ``acquire`` past
that waits for a ``release``. That is how the multi-path copier keeps its promise never to
take more of a peer's memory than it was given.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

__all__ = ["StagingPool", "PoolClosed"]


class PoolClosed(RuntimeError):
    """``acquire`` gave up: the pool was closed or the caller's cancel event was set."""


class StagingPool:
    """Up to ``max_slots`` equal-size uint8 buffers, made lazily and reused.

    Args:
        alloc: makes one buffer of ``slot_bytes`` (called at most ``max_slots`` times).
        slot_bytes: bytes per buffer.
        max_slots: most buffers alive at once; at least 1.
        free: gives a buffer back when the pool closes (None: drop the reference).
        name: for messages.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], slot_bytes: int, max_slots: int, *,
                 free: Callable[[torch.Tensor], None] | None = None, name: str = "pool") -> None:
        if slot_bytes <= 0 or max_slots < 1:
            raise ValueError(f"{name}: need slot_bytes > 0 and max_slots >= 1, got {slot_bytes} and {max_slots}")
        self._alloc, self._free = alloc, free
        self.slot_bytes, self.max_slots, self.name = int(slot_bytes), int(max_slots), name
        self._idle: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self._peak_allocated = 0
        self._peak_in_use = 0
        self._closed = False
        self._cv = threading.Condition()

    @classmethod
    def on_device(cls, backend: Any, device: int, slot_bytes: int, budget_bytes: int) -> "StagingPool":
        """A pool in ``device``'s memory taking at most ``budget_bytes`` (whole slots).

        Raises:
            ValueError: the budget is smaller than one slot.
        """
        slots = budget_bytes // slot_bytes
        if slots < 1:
            raise ValueError(
                f"staging budget of {budget_bytes} B on device {device} is smaller than one chunk of {slot_bytes} B; "
                f"raise the peer memory budget or lower chunk_bytes"
            )

        def alloc(n: int) -> torch.Tensor:
            with backend.device_scope(device):
                return backend.empty(n, torch.uint8, device)

        return cls(alloc, slot_bytes, slots, name=f"staging pool on device {device}")

    @classmethod
    def on_host(cls, arena: Any, slot_bytes: int, max_slots: int) -> "StagingPool":
        """A pool of pinned host buffers from ``arena`` (an :class:`xpu.HostArena`)."""
        return cls(lambda n: arena.empty(n), slot_bytes, max_slots, free=arena.release, name="host staging pool")

    @property
    def bound_bytes(self) -> int:
        """The most bytes this pool will ever hold."""
        return self.slot_bytes * self.max_slots

    @property
    def high_water_bytes(self) -> int:
        """The most bytes it has held at once."""
        return self._peak_allocated * self.slot_bytes

    @property
    def peak_in_use(self) -> int:
        """The most buffers handed out at once."""
        return self._peak_in_use

    @property
    def in_use(self) -> int:
        """Buffers handed out now."""
        return self._in_use

    def reserve(self) -> None:
        """Make every slot now, so no transfer pays for (or is timed with) an allocation."""
        bufs = []
        with self._cv:
            missing = self.max_slots - self._allocated
            self._allocated += missing
            self._peak_allocated = max(self._peak_allocated, self._allocated)
        try:
            for _ in range(missing):
                bufs.append(self._alloc(self.slot_bytes))
        finally:
            with self._cv:
                self._allocated -= missing - len(bufs)
                self._idle.extend(bufs)
                self._cv.notify_all()

    def try_acquire(self) -> torch.Tensor | None:
        """A buffer if one is free (or may still be made) right now, else None; never waits."""
        with self._cv:
            if self._closed or (not self._idle and self._allocated >= self.max_slots):
                return None
        try:
            return self.acquire(timeout=0)
        except PoolClosed:  # another thread took the last one in between
            return None

    def acquire(self, timeout: float | None = None, cancel: threading.Event | None = None) -> torch.Tensor:
        """A free buffer, made if fewer than ``max_slots`` exist, else after waiting for one.

        Raises:
            PoolClosed: the pool closed, ``cancel`` was set, or ``timeout`` seconds passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed or (cancel is not None and cancel.is_set()):
                    raise PoolClosed(f"{self.name}: closed or cancelled while waiting for a buffer")
                if self._idle:
                    buf = self._idle.pop()
                    break
                if self._allocated < self.max_slots:
                    self._allocated += 1  # reserve before allocating outside the lock
                    self._peak_allocated = max(self._peak_allocated, self._allocated)
                    buf = None
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PoolClosed(f"{self.name}: no buffer free after {timeout} s ({self.max_slots} in use)")
                self._cv.wait(0.05 if left is None else min(left, 0.05))  # wake to see cancel
            self._in_use += 1
            self._peak_in_use = max(self._peak_in_use, self._in_use)
        if buf is None:
            try:
                buf = self._alloc(self.slot_bytes)
            except BaseException:
                with self._cv:
                    self._allocated -= 1
                    self._in_use -= 1
                    self._cv.notify()
                raise
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire`."""
        with self._cv:
            self._in_use -= 1
            if self._closed:
                self._allocated -= 1
                if self._free:
                    self._free(buf)
            else:
                self._idle.append(buf)
            self._cv.notify()

    def close(self) -> None:
        """Free idle buffers; buffers still out are freed when released."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._allocated -= len(idle)
            self._cv.notify_all()
        if self._free:
            for buf in idle:
                self._free(buf)
