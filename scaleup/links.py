"""Link models: the one place a hop's bytes are actually copied, and the fault-injection point.

Every hop of a :class:`~scaleup.routes.Route` carries a :class:`LinkModel`. The copier calls
``model.copy(dst, src, stream)`` once per contiguous byte range it moves over that hop, with
the hop's stream made current; by default :class:`BackendLink` forwards to
``backend.copy``. Tests and chaos runs wrap a hop's model (``Route.with_models``) to make a
link slow (:class:`ThrottledLink`), fail (:class:`FailingLink`) or hang (:class:`StalledLink`),
without patching the copier. On an accelerator a wrapper's host-side delay does not show in
device-event timings, so these wrappers are meant for the cpu reference backend, whose events
are wall-clock.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["LinkModel", "BackendLink", "ThrottledLink", "FailingLink", "StalledLink", "LinkFailure"]


class LinkFailure(RuntimeError):
    """A link refused to move bytes (raised by :class:`FailingLink` and :class:`StalledLink`)."""


@runtime_checkable
class LinkModel(Protocol):
    """Moves bytes over one hop: ``copy(dst, src, stream)`` with ``dst.shape == src.shape``."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue (or do) the copy of ``src`` into ``dst`` on ``stream``."""


class BackendLink:
    """The real link: ``backend.copy(dst, src, stream)``.

    Args:
        backend: the :class:`xpu.Backend` that owns the devices.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Copy through the backend."""
        self.backend.copy(dst, src, stream)

    def __repr__(self) -> str:
        return f"BackendLink({self.backend.name})"


class ThrottledLink:
    """A link that behaves as if it ran at ``GBps`` (sleeps ``nbytes / rate`` per copy).

    ``slow_after_bytes``/``slow_GBps`` switch it to a lower rate once that many bytes have
    passed, to model a link that gets congested mid-transfer. ``GBps`` may also be set at any
    time from another thread.

    Args:
        inner: the model that really copies.
        GBps: modelled rate in GB/s (10**9 B/s); must be positive.
        slow_after_bytes: bytes after which ``slow_GBps`` applies (None: never).
        slow_GBps: the rate after ``slow_after_bytes``.
    """

    def __init__(self, inner: LinkModel, GBps: float, *, slow_after_bytes: int | None = None, slow_GBps: float | None = None) -> None:
        if GBps <= 0 or (slow_GBps is not None and slow_GBps <= 0):
            raise ValueError(f"ThrottledLink rates must be positive, got GBps={GBps}, slow_GBps={slow_GBps}")
        if (slow_after_bytes is None) != (slow_GBps is None):
            raise ValueError("give slow_after_bytes and slow_GBps together")
        self.inner, self.GBps = inner, float(GBps)
        self.slow_after_bytes, self.slow_GBps = slow_after_bytes, slow_GBps
        self.bytes_moved = 0
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Sleep for the modelled time, then copy."""
        nbytes = src.numel() * src.element_size()
        with self._lock:
            slow = self.slow_after_bytes is not None and self.bytes_moved >= self.slow_after_bytes
            rate = self.slow_GBps if slow else self.GBps
            self.bytes_moved += nbytes
        time.sleep(nbytes / (rate * 1e9))
        self.inner.copy(dst, src, stream)


class FailingLink:
    """A link that raises :class:`LinkFailure` once ``fail_after_bytes`` have passed.

    Args:
        inner: the model that really copies until the failure.
        fail_after_bytes: bytes copied successfully before every later copy raises.
    """

    def __init__(self, inner: LinkModel, fail_after_bytes: int = 0) -> None:
        if fail_after_bytes < 0:
            raise ValueError(f"fail_after_bytes must be >= 0, got {fail_after_bytes}")
        self.inner, self.fail_after_bytes = inner, fail_after_bytes
        self.bytes_moved = 0
        self.failures = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Copy, or raise once the budget of good bytes is spent."""
        if self.bytes_moved >= self.fail_after_bytes:
            self.failures += 1
            raise LinkFailure(f"injected link failure after {self.bytes_moved} B")
        self.bytes_moved += src.numel() * src.element_size()
        self.inner.copy(dst, src, stream)


class StalledLink:
    """A link that hangs once ``stall_after_bytes`` have passed, until :meth:`release`.

    A released stalled copy raises :class:`LinkFailure` instead of copying, so a late
    completion can never write into a destination the copier has already handed back.

    Args:
        inner: the model that really copies until the stall.
        stall_after_bytes: bytes copied before the next copy hangs.
    """

    def __init__(self, inner: LinkModel, stall_after_bytes: int = 0) -> None:
        self.inner, self.stall_after_bytes = inner, stall_after_bytes
        self.bytes_moved = 0
        self.stalled = threading.Event()  # set while a copy is hanging
        self._release = threading.Event()

    def release(self) -> None:
        """Let hanging copies return (they raise :class:`LinkFailure`)."""
        self._release.set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Copy, or hang until released once past the byte budget."""
        if self.bytes_moved >= self.stall_after_bytes:
            self.stalled.set()
            self._release.wait()
            raise LinkFailure("injected stall released")
        self.bytes_moved += src.numel() * src.element_size()
        self.inner.copy(dst, src, stream)
