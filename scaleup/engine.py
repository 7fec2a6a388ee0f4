"""The transfer engine: asynchronous host↔device copies of one tensor or a group of tensors.

* One dedicated copy stream per (direction, device), so host→device and device→host run at
  once and neither waits behind compute.
* Pinned sources/destinations are copied whole, straight from the calling thread: nothing is
  added to a raw pinned copy but a stream wait and an event.
* Pageable ones go through pinned staging buffers from the backend's host arena, in chunks,
  double-buffered by a worker thread per direction: the host packs chunk k+1 while the DMA
  engine moves chunk k.
* Each call returns a :class:`~scaleup.handles.Transfer` whose ``wait(stream)`` orders a
  compute stream after the data, without blocking the host when every copy was queued at
  call time.

Destinations are written on the copy stream after the device's current stream has reached
the call point, so a buffer still being read by earlier compute is not overwritten early.

    engine = TransferEngine(backend)
    t = engine.h2d(params, device=0)      # list of host tensors -> list of device tensors
    t.wait()                              # current stream of device 0 waits; host does not
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable

import torch

import xpu
from xpu import in_host_memory
from xpu.units import parse_bytes

from .chunks import TensorGroup, as_group, byte_view, check_pairs, device_outputs, make_chunks
from .handles import Transfer

__all__ = ["TransferEngine"]

_DIRECTIONS = ("h2d", "d2h")


class _Worker:
    """One daemon thread running submitted jobs in order (one per direction)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()  # jobs catch their own errors and record them on their Transfer


class TransferEngine:
    """Chunked, pipelined host→device and device→host copies over dedicated streams.

    Args:
        backend: the :class:`xpu.Backend` (default ``xpu.get_backend()``).
        chunk_bytes: staging chunk size for pageable memory (``"16MiB"`` style accepted).
        staging_slots: pinned staging buffers per direction; 2 is double buffering.

    Raises:
        ValueError: a non-positive chunk size or fewer than one staging slot.
    """

    def __init__(self, backend: xpu.Backend | None = None, *, chunk_bytes: int | str = 16 * 2**20, staging_slots: int = 2) -> None:
        chunk = parse_bytes(chunk_bytes)
        if chunk <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        if staging_slots < 1:
            raise ValueError(f"staging_slots must be at least 1, got {staging_slots}")
        self.backend = backend or xpu.get_backend()
        self.chunk_bytes, self.staging_slots = chunk, staging_slots
        self._streams: dict[tuple[str, int], Any] = {}
        self._slots: dict[str, list[list[Any]]] = {}  # direction -> [[buffer, last event], ...]
        self._workers: dict[str, _Worker] = {}
        self._inflight: list[Transfer] = []
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ public
    def stream(self, direction: str, device: Any = None) -> Any:
        """The engine's copy stream for ``direction`` (``"h2d"``/``"d2h"``) on ``device``."""
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
        dev = self.backend.index_of(device)
        with self._lock:
            key = (direction, dev)
            if key not in self._streams:
                self._streams[key] = self.backend.stream(dev)
            return self._streams[key]

    def h2d(self, src: TensorGroup, device: Any = None, *, out: TensorGroup | None = None) -> Transfer:
        """Copy host tensor(s) to ``device``; return a handle whose ``result`` holds the copies.

        Args:
            src: a contiguous host tensor or a list/tuple of them (any dtypes, any sizes).
            device: the target device (default: current).
            out: device tensor(s) to fill, matching ``src`` in count, shape and dtype
                (default: new ones).

        Raises:
            TypeError, ValueError: bad input (not tensors, not on the host, non-contiguous,
                mismatched ``out``), before anything is queued.
        """
        self._check_open()
        b = self.backend
        srcs, single = as_group(src, "src")
        dev = b.index_of(device)
        for i, s in enumerate(srcs):
            if not in_host_memory(s):
                raise ValueError(f"src[{i}] is on {s.device}; h2d copies from host memory")
        src_bytes = [byte_view(s, f"src[{i}]") for i, s in enumerate(srcs)]
        outs = device_outputs(b, srcs, out, dev)
        dst_bytes = [byte_view(o, f"out[{i}]") for i, o in enumerate(outs)]
        pinned = [b.is_pinned(s) for s in srcs]

        return self._launch("h2d", dev, outs[0] if single else outs, src_bytes, dst_bytes, pinned,
                            host=srcs, device_side=outs, staged_fn=self._staged_h2d)

    def d2h(self, src: TensorGroup, *, out: TensorGroup | None = None, device: Any = None) -> Transfer:
        """Copy device tensor(s) to host memory; return a handle whose ``result`` holds the copies.

        ``wait(stream)`` on the handle means the device side is done (``src`` may be
        overwritten); ``synchronize()`` means the host copies are complete.

        Args:
            src: a contiguous device tensor or a list/tuple of them.
            out: host tensor(s) to fill (pinned is fastest; pageable goes through staging);
                default: new pinned tensors of exactly the right size.
            device: the device holding ``src`` (default: the tensors' own, else current).

        Raises:
            TypeError, ValueError: bad input, before anything is queued.
        """
        self._check_open()
        b = self.backend
        srcs, single = as_group(src, "src")
        for i, s in enumerate(srcs):
            if s.device.type != b.device_type:
                raise ValueError(f"src[{i}] is on {s.device}, not a {b.name} device; d2h copies from device memory")
        if device is None and srcs and srcs[0].device.index is not None:
            device = srcs[0].device.index
        dev = b.index_of(device)
        src_bytes = [byte_view(s, f"src[{i}]") for i, s in enumerate(srcs)]
        if out is None:
            outs = [self._new_pinned(s) for s in srcs]
        else:
            outs, _ = as_group(out, "out")
            check_pairs(srcs, outs)
            for i, o in enumerate(outs):
                if not in_host_memory(o):
                    raise ValueError(f"out[{i}] is on {o.device}; d2h writes host memory")
        dst_bytes = [byte_view(o, f"out[{i}]") for i, o in enumerate(outs)]
        pinned = [b.is_pinned(o) for o in outs]

        return self._launch("d2h", dev, outs[0] if single else outs, src_bytes, dst_bytes, pinned,
                            host=outs, device_side=srcs, staged_fn=self._staged_d2h)

    def synchronize(self) -> None:
        """Block until every transfer started by this engine has finished."""
        for t in list(self._inflight):
            try:
                t.synchronize()
            except Exception:  # a failed transfer reports its error to its own owner
                pass
        self._prune()

    def close(self) -> None:
        """Finish outstanding work, stop the worker threads and return staging to the arena."""
        if self._closed:
            return
        self.synchronize()
        for w in self._workers.values():
            w.stop()
        for slots in self._slots.values():
            for buf, event in slots:
                if event is not None:
                    event.synchronize()
                self.backend.host_arena.release(buf)
        self._workers.clear()
        self._slots.clear()
        self._closed = True

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TransferEngine is closed; make a new one")

    def _new_pinned(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        buf = self.backend.alloc_pinned(nbytes)  # exact size; freed with the tensor
        return buf.view(like.dtype).view(like.shape) if nbytes else torch.empty(like.shape, dtype=like.dtype)

    def _launch(self, direction: str, dev: int, result: Any, src_bytes: list[torch.Tensor], dst_bytes: list[torch.Tensor],
                pinned: list[bool], host: list[torch.Tensor], device_side: list[torch.Tensor],
                staged_fn: Callable[[Transfer, list[tuple[torch.Tensor, torch.Tensor]], Any], None]) -> Transfer:
        """Queue one transfer: pinned pairs straight from this thread, pageable ones through
        the direction's staging worker. ``host`` tensors are kept alive by the handle,
        ``device_side`` ones marked in use on the copy stream."""
        stream = self.stream(direction, dev)
        transfer = Transfer(self.backend, dev, direction, result, sum(s.numel() for s in src_bytes), keep=host)
        self._order_after_compute(stream, dev)
        for t in device_side:
            self.backend.keep_alive(t, stream)
        direct = [(d, s) for s, d, p in zip(src_bytes, dst_bytes, pinned) if p and s.numel()]
        staged = [(s, d) for s, d, p in zip(src_bytes, dst_bytes, pinned) if not p and s.numel()]
        self._issue_direct(transfer, direct, stream)
        if staged:
            self._worker(direction).submit(lambda: self._guard(transfer, lambda: staged_fn(transfer, staged, stream)))
        else:
            transfer._mark_finished()
        self._track(transfer)
        return transfer

    def _order_after_compute(self, stream: Any, dev: int) -> None:
        # Destination (h2d) or source (d2h) may still be in use by work queued before this call.
        with self.backend.device_scope(dev):
            stream.wait_stream(self.backend.current_stream(dev))

    def _issue_direct(self, transfer: Transfer, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
        if not pairs:
            return
        for dst, src in pairs:
            self.backend.copy(dst, src, stream)
        event = self.backend.event()
        event.record(stream)
        transfer._add_event(event)

    def _worker(self, direction: str) -> _Worker:
        with self._lock:
            if direction not in self._workers:
                self._workers[direction] = _Worker(f"scaleup-{direction}-staging")
            return self._workers[direction]

    def _staging(self, direction: str) -> list[list[Any]]:
        if direction not in self._slots:
            self._slots[direction] = [[self.backend.host_arena.empty(self.chunk_bytes), None] for _ in range(self.staging_slots)]
        return self._slots[direction]

    @staticmethod
    def _guard(transfer: Transfer, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # reported through the handle, never lost in the thread
            transfer._fail(exc)

    def _staged_h2d(self, transfer: Transfer, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
        b, slots = self.backend, self._staging("h2d")
        last = None
        for k, chunk in enumerate(make_chunks([(s, d, False) for s, d in pairs], self.chunk_bytes)):
            slot = slots[k % len(slots)]
            if slot[1] is not None:
                slot[1].synchronize()  # the DMA that last read this buffer has finished
            buf = slot[0]
            for seg in chunk.segments:
                buf[seg.offset:seg.offset + seg.src.numel()].copy_(seg.src)
            for seg in chunk.segments:
                b.copy(seg.dst, buf[seg.offset:seg.offset + seg.src.numel()], stream)
            last = b.event()
            last.record(stream)
            slot[1] = last
        if last is not None:
            transfer._add_event(last)
        transfer._mark_finished()

    def _staged_d2h(self, transfer: Transfer, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
        b, slots = self.backend, self._staging("d2h")
        pending: deque = deque()

        def unpack_oldest() -> None:
            chunk, slot = pending.popleft()
            slot[1].synchronize()
            for seg in chunk.segments:
                seg.dst.copy_(slot[0][seg.offset:seg.offset + seg.src.numel()])

        for k, chunk in enumerate(make_chunks([(s, d, False) for s, d in pairs], self.chunk_bytes)):
            if len(pending) == len(slots):
                unpack_oldest()  # frees the slot this chunk is about to use
            slot = slots[k % len(slots)]
            for seg in chunk.segments:
                b.copy(slot[0][seg.offset:seg.offset + seg.src.numel()], seg.src, stream)
            slot[1] = b.event()
            slot[1].record(stream)
            pending.append((chunk, slot))
        if pending:
            transfer._add_event(pending[-1][1][1])
        transfer._mark_queued()  # device side fully queued: a stream may wait on it now
        while pending:
            unpack_oldest()
        transfer._mark_finished()

    def _track(self, transfer: Transfer) -> None:
        # The engine keeps handles (and so their host buffers) alive until the copies finish,
        # even if the caller drops the handle.
        self._prune()
        with self._lock:
            self._inflight.append(transfer)

    def _prune(self) -> None:
        with self._lock:
            self._inflight = [t for t in self._inflight if not t.done()]
