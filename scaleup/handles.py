"""Completion handles: what ``h2d``/``d2h`` return while the bytes are still moving."""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["Transfer", "TransferError"]


class TransferError(RuntimeError):
    """A transfer could not complete (every route failed, or a copy raised)."""


class Transfer:
    """A handle on one asynchronous transfer.

    ``wait(stream)`` makes a compute stream wait for the data without blocking the host when
    the engine queued every copy at call time (pinned sources and destinations). Where host
    threads still have copies to queue (pageable staging, multi-path dispatch) it first waits,
    on the host, until they are queued: a stream cannot wait on work not yet submitted.

    Attributes:
        result: the destination tensor, or list of tensors for a group.
        nbytes: bytes moved.
        device: the device index involved.
        direction: ``"h2d"`` or ``"d2h"``.
        stats: figures filled in by whoever ran it (per-route bytes, timings, ...).
    """

    def __init__(self, backend: Any, device: int, direction: str, result: Any, nbytes: int, keep: Any = ()) -> None:
        self.backend, self.device, self.direction = backend, device, direction
        self.result, self.nbytes = result, nbytes
        self.stats: dict[str, Any] = {}
        self._keep = list(keep)  # host tensors that must outlive the copies reading/writing them
        self._events: list[Any] = []
        self._queued = threading.Event()  # every device copy has been submitted
        self._finished = threading.Event()  # host-side work (unpacking, bookkeeping) is over
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []  # host threads working for this transfer
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ producer side
    def _add_event(self, event: Any) -> None:
        with self._lock:
            self._events.append(event)

    def _mark_queued(self) -> None:
        self._queued.set()

    def _mark_finished(self) -> None:
        self._queued.set()
        self._finished.set()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
        self._mark_finished()

    # ------------------------------------------------------------------ consumer side
    @property
    def error(self) -> BaseException | None:
        """The exception that ended the transfer, if any."""
        return self._error

    def done(self) -> bool:
        """Whether the transfer is over (successfully or not); never blocks."""
        if not self._finished.is_set():
            return False
        return self._error is not None or all(e.query() for e in list(self._events))

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the device's current stream) wait for the data.

        Raises:
            TransferError: the transfer failed.
        """
        self._queued.wait()
        self._raise()
        stream = stream if stream is not None else self.backend.current_stream(self.device)
        for event in list(self._events):
            stream.wait_event(event)

    def synchronize(self, timeout: float | None = None) -> Any:
        """Block the host until the data has arrived; return :attr:`result`.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (host-side part).
            TransferError: the transfer failed.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.direction} transfer of {self.nbytes} B not finished after {timeout} s")
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)  # finished already but for returning; joined so none outlives use
        self._raise()
        for event in list(self._events):
            event.synchronize()
        self._keep.clear()
        return self.result

    def _raise(self) -> None:
        if self._error is not None:
            if isinstance(self._error, TransferError):
                raise self._error
            raise TransferError(f"{self.direction} transfer of {self.nbytes} B failed: {self._error!r}") from self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "in flight")
        return f"<Transfer {self.direction} device={self.device} {self.nbytes} B {state}>"
