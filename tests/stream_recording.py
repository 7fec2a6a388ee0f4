"""A cpu-backend stand-in that checks the stream contract of asynchronous copies.

On the cpu backend every copy is synchronous, so a missing event wait or a tensor freed under a
pending copy never shows as wrong numbers. :class:`StreamCheck` wraps the cpu backend and orders
what the code asks of streams and events as a device would (one vector clock per stream and one
for the host), and lists every breach of the contract in :attr:`StreamCheck.breaches`:

* a stream reads bytes another stream wrote, or overwrites bytes another stream read or wrote,
  with no event ordering the two (a side-stream copy reading a tensor before the kernel that
  makes it, the compute stream reading a copy's destination before waiting for the copy);
* memory is freed (its last reference dropped, or ``free_storage``) while a copy on another
  stream may still use it, unless ``keep_alive`` named that stream after the copy, or the
  stream that allocated the memory (where the allocator reuses it) or the host is known past it;
* a pinned host buffer goes back to the arena while a copy into or out of it may be pending
  (no host-side synchronize past it).

Every op the checking thread runs (forward and backward: a ``TorchDispatchMode``) counts as a
kernel on its current stream; ``use_stream`` makes a stream current, as on CUDA. Copies are the
ones given to ``backend.copy``. Ops of other threads (the host optimizer, staging workers) are
not seen, and host-only ops count as compute kernels: the check is about device streams.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["StreamCheck"]


class _Stream:
    """A stream as the code sees it; its orderings go to the checker."""

    def __init__(self, check: "StreamCheck", device: int, name: str, side: bool) -> None:
        self._check, self.device_index, self.name, self.side = check, device, name, side

    def wait_event(self, event: "_Event") -> None:
        """Later work on this stream follows ``event``'s record."""
        self._check._merge(self._check._clock(self), event._clock)

    def wait_stream(self, other: "_Stream") -> None:
        """Later work on this stream follows everything queued on ``other`` so far."""
        self._check._merge(self._check._clock(self), self._check._clock(other))

    def synchronize(self) -> None:
        """The host is past everything queued here."""
        self._check._merge(self._check._host, self._check._clock(self))

    def query(self) -> bool:
        """True (work is synchronous); the host is then past it."""
        self.synchronize()
        return True

    def record_event(self, event: "_Event | None" = None) -> "_Event":
        """Record (and return) an event here."""
        event = event or self._check.event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return self.name


class _Event:
    """An event: the clock of its stream when recorded."""

    def __init__(self, check: "StreamCheck", inner: Any) -> None:
        self._check, self._inner = check, inner
        self._clock: dict[_Stream, int] = {}  # never recorded: waiting on it orders nothing, as in CUDA

    def record(self, stream: _Stream | None = None) -> None:
        """Take the clock of ``stream`` (default: the current stream)."""
        stream = stream or self._check.current_stream()
        with self._check._lock:
            self._check._poll()
            self._clock = dict(self._check._clock(stream))
        self._inner.record()

    def synchronize(self) -> None:
        """The host is past this event."""
        self._check._merge(self._check._host, self._clock)

    def query(self) -> bool:
        """True (work is synchronous); the host is then past this event."""
        self.synchronize()
        return True

    def wait(self, stream: _Stream | None = None) -> None:
        """``stream`` (default: the current one) waits for this event."""
        (stream or self._check.current_stream()).wait_event(self)

    def elapsed_time(self, end: "_Event") -> float:
        """Milliseconds between two records (the inner events' clocks)."""
        return self._inner.elapsed_time(end._inner)


@dataclass
class _Access:
    stream: _Stream
    pos: int  # the stream's op count at this access
    lo: int  # byte range within the storage
    hi: int
    write: bool


@dataclass
class _Store:
    ref: StorageWeakRef
    nbytes: int
    alloc: _Stream  # the stream whose pool the memory goes back to
    accesses: list[_Access] = field(default_factory=list)
    kept: dict[_Stream, int] = field(default_factory=dict)  # keep_alive: stream -> its op count then


class _Arena:
    """The inner host arena; ``release`` is checked against pending copies."""

    def __init__(self, check: "StreamCheck", inner: Any) -> None:
        self._check, self._inner = check, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def release(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` back once no copy may still use it (else a breach is listed)."""
        self._check._given_back(tensor)
        self._inner.release(tensor)


class _Kernels(TorchDispatchMode):
    def __init__(self, check: "StreamCheck") -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.check._quiet():
            self.check._kernel(func, args, kwargs, out)
        return out


_METADATA = {torch.ops.aten.is_pinned.default}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and t.device.type == "cpu" and t.untyped_storage().nbytes() > 0]


def _span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return lo, lo + extent * size


class StreamCheck:
    """The cpu backend ``inner``, with the stream contract of its copies checked (module docstring).

    Use as a context manager around the code under test; then assert ``breaches == []``.
    Everything but the stream, event, copy and memory verbs is ``inner``'s own.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._pos: dict[_Stream, int] = {}
        self._clocks: dict[_Stream, dict[_Stream, int]] = {}
        self._host: dict[_Stream, int] = {}  # how far the host has synchronised with each stream
        self._stores: dict[int, _Store] = {}  # StorageImpl address -> what happened to it
        self._watched: set[int] = set()  # stores another stream than their allocator's touched
        self._compute = [_Stream(self, i, f"compute{i}", side=False) for i in range(inner.device_count())]
        self._arena: _Arena | None = None
        self._mode = _Kernels(self)
        self._streams = 0
        self._ticks = 0
        #: One line per breach of the contract, in the order found.
        self.breaches: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> "StreamCheck":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        with self._lock:
            self._poll()

    # ------------------------------------------------------------------ backend verbs
    def stream(self, device: Any = None, priority: int = 0) -> _Stream:
        """A new side stream."""
        with self._lock:
            self._streams += 1
            return _Stream(self, self._inner.index_of(device), f"side stream {self._streams}", side=True)

    def current_stream(self, device: Any = None) -> _Stream:
        """The stream made current by ``use_stream``, else the device's compute stream."""
        index = self._inner.index_of(device)
        stack = self._stack()
        if stack and stack[-1].device_index == index:
            return stack[-1]
        return self._compute[index]

    @contextlib.contextmanager
    def use_stream(self, stream: _Stream) -> Iterator[_Stream]:
        """Make ``stream`` current in this thread."""
        self._stack().append(stream)
        try:
            yield stream
        finally:
            self._stack().pop()

    def event(self, timing: bool = False, blocking: bool = False) -> _Event:
        """A new event (``blocking`` changes how a host waits on it, not what it orders)."""
        return _Event(self, self._inner.event(timing, blocking))

    def synchronize(self, device: Any = None) -> None:
        """The host is past everything queued on every stream."""
        with self._lock:
            self._merge(self._host, dict(self._pos))

    def keep_alive(self, tensor: torch.Tensor, stream: _Stream) -> None:
        """Note that ``tensor``'s memory outlives the work queued on ``stream`` so far."""
        with self._lock:
            self._poll()
            self._store(tensor).kept[stream] = self._pos.get(stream, 0)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: _Stream | None = None) -> None:
        """Note a copy on ``stream`` reading ``src`` and writing ``dst``, then copy."""
        stream = stream or self.current_stream()
        with self._lock:
            self._poll()
            pos = self._tick(stream)
            self._access(stream, pos, src, write=False)
            self._access(stream, pos, dst, write=True)
        with self._quietly():
            self._inner.copy(dst, src)

    def to_device(self, tensor: torch.Tensor, device: Any = None, stream: _Stream | None = None) -> torch.Tensor:
        """``empty`` then :meth:`copy`."""
        out = self.empty(tensor.shape, tensor.dtype, device)
        self.copy(out, tensor, stream)
        return out

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Check that no other stream may still use the memory, then free it."""
        with self._lock:
            self._poll()
            self._freed(self._key(tensor), "free_storage")
        self._inner.free_storage(tensor)

    def realloc_storage(self, tensor: torch.Tensor, device: Any = None) -> None:
        """Fresh memory from the current stream's pool."""
        with self._quietly():
            self._inner.realloc_storage(tensor, device)
        stream = self.current_stream()
        with self._lock:
            store = self._store(tensor)
            store.alloc, store.nbytes = stream, tensor.untyped_storage().nbytes()
            store.accesses, store.kept = [], {}
            # Memory from a stream's pool counts as written there: that stream's earlier kernels
            # may still use it (a side stream writing it must wait for them).
            with self._quietly():
                whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
            self._access(stream, self._tick(stream), whole, write=True)

    @property
    def host_arena(self) -> _Arena:
        """The inner arena, its releases checked."""
        if self._arena is None:
            self._arena = _Arena(self, self._inner.host_arena)
        return self._arena

    # ------------------------------------------------------------------ the clocks
    def _stack(self) -> list[_Stream]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack, self._tls.quiet = [], 0
        return self._tls.stack

    def _quiet(self) -> bool:
        self._stack()
        return self._tls.quiet > 0

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        self._stack()
        self._tls.quiet += 1
        try:
            yield
        finally:
            self._tls.quiet -= 1

    def _clock(self, stream: _Stream) -> dict[_Stream, int]:
        clock = self._clocks.setdefault(stream, {})
        clock[stream] = self._pos.get(stream, 0)
        return clock

    def _merge(self, into: dict[_Stream, int], clock: dict[_Stream, int]) -> None:
        with self._lock:
            self._poll()  # a tensor dropped before this wait was freed before it
            for s, n in clock.items():
                if into.get(s, 0) < n:
                    into[s] = n

    def _tick(self, stream: _Stream) -> int:
        self._pos[stream] = self._pos.get(stream, 0) + 1
        self._ticks += 1
        if self._ticks % 4096 == 0:  # forget dead tensors no other stream touched
            for key in [k for k, st in self._stores.items() if k not in self._watched and st.ref.expired()]:
                del self._stores[key]
        return self._pos[stream]

    # ------------------------------------------------------------------ memory
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _store(self, t: torch.Tensor, alloc: _Stream | None = None) -> _Store:
        key = self._key(t)
        store = self._stores.get(key)
        if store is None:
            storage = t.untyped_storage()
            alloc = alloc or self.current_stream()
            store = self._stores[key] = _Store(StorageWeakRef(storage), storage.nbytes(), alloc)
        return store

    def _access(self, stream: _Stream, pos: int, t: torch.Tensor, write: bool, fresh: bool = False) -> None:
        if t.untyped_storage().nbytes() == 0:
            return
        key = self._key(t)
        # A new tensor's memory comes from its stream's pool (a store seen before is an aliased input).
        store = self._store(t, alloc=stream if fresh else None)
        lo, hi = _span(t)
        clock = self._clock(stream)
        for a in store.accesses:
            if a.stream is stream or a.hi <= lo or hi <= a.lo or not (write or a.write):
                continue
            # Work queued after the host saw ``a`` finish (any thread: lenient) follows it too.
            if max(clock.get(a.stream, 0), self._host.get(a.stream, 0)) < a.pos:
                self.breaches.append(
                    f"{stream} {'writes' if write else 'reads'} bytes {lo}:{hi} of a {store.nbytes} B buffer that "
                    f"{a.stream} {'wrote' if a.write else 'read'} in its op {a.pos}, with no event ordering the two")
        # A later access of the same stream stands for earlier ones it covers.
        store.accesses = [a for a in store.accesses
                          if not (a.stream is stream and lo <= a.lo and a.hi <= hi and (write or not a.write))]
        store.accesses.append(_Access(stream, pos, lo, hi, write))
        if stream is not store.alloc:
            self._watched.add(key)

    def _pending(self, store: _Store, a: _Access) -> bool:
        """Whether access ``a`` may still run when the memory goes back to its allocator's pool."""
        return (a.stream is not store.alloc and store.kept.get(a.stream, -1) < a.pos
                and self._clock(store.alloc).get(a.stream, 0) < a.pos and self._host.get(a.stream, 0) < a.pos)

    def _freed(self, key: int, how: str) -> None:
        store = self._stores.get(key)
        if store is None:
            return
        for a in store.accesses:
            if self._pending(store, a):
                self.breaches.append(
                    f"a {store.nbytes} B buffer of {store.alloc}'s pool was freed ({how}) while {a.stream}'s "
                    f"{'write into' if a.write else 'read of'} it (its op {a.pos}) may be pending: no keep_alive on "
                    f"{a.stream} after it, and neither {store.alloc} nor the host waited for it")
        store.accesses, store.kept = [], {}
        self._watched.discard(key)

    def _poll(self) -> None:
        """Check the memory of every dropped tensor another stream touched (called at every verb,
        so a drop is seen before anything else happens)."""
        for key in [k for k in self._watched if self._stores[k].ref.expired()]:
            self._freed(key, "its last reference was dropped")
            del self._stores[key]

    def _given_back(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._poll()
            store = self._stores.get(self._key(tensor))
            if store is None:
                return
            for a in store.accesses:
                if a.stream.side and self._host.get(a.stream, 0) < a.pos:
                    self.breaches.append(
                        f"a {store.nbytes} B pinned buffer went back to the arena while {a.stream}'s "
                        f"{'write into' if a.write else 'read of'} it (its op {a.pos}) may be pending")
            store.accesses, store.kept = [], {}
            self._watched.discard(self._key(tensor))

    def _kernel(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        schema = func._schema
        if func in _METADATA or (schema.returns and all(r.alias_info is not None and not r.alias_info.is_write
                                                         for r in schema.returns)):
            return  # a view, or a question about metadata: no bytes are read
        stream = self.current_stream()
        with self._lock:
            self._poll()
            pos = self._tick(stream)
            for t in _tensors((args, kwargs)):
                self._access(stream, pos, t, write=False)
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for t in _tensors(value):
                        self._access(stream, pos, t, write=True)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for ret, value in zip(schema.returns, outs):
                if ret.alias_info is None:  # a new tensor (views and in-place results alias an argument)
                    for t in _tensors(value):
                        self._access(stream, pos, t, write=True, fresh=True)
