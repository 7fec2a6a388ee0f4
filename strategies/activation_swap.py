"""Saved activations swapped out of device memory during forward and back in for backward.

Shared by MPress (host or peer-device destinations, per pipeline block) and MemFerry
(activation offload to host, per block). Inside :meth:`ActivationSwapper.hooks`, each
tensor autograd saves is copied on a side stream into a pinned host buffer from the arena
(``"host"``) or into this process's region of a peer device's pool (a peer index), and
autograd keeps only a small handle, so the device memory is freed when forward drops its
own references. :meth:`ActivationSwapper.prefetch` brings a group's tensors back on another
side stream (callers issue it when backward reaches the block, plus look-ahead); the unpack
hook makes the compute stream wait for that copy's event, so no kernel reads a half-written
tensor, and the swap-out's event orders the prefetch after it.

Parameters and tensors below ``min_bytes`` are kept on the device. A saved view that is not a
permutation of a dense layout (a slice of a fused projection's output, as ``q``, ``k``, ``v`` of
one ``qkv`` matmul) swaps its whole storage, once per group however many views share it, and
comes back as the same view of the restored storage: keeping it would keep the whole storage on
the device. Every byte is counted by destination in :class:`SwapStats`, so tests can check that
a swap really happened.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SwapStats", "SwapGroup", "ActivationSwapper", "RegionAllocatorLike"]


@dataclass
class SwapStats:
    """Bytes and events by destination, since creation (or :meth:`reset`).

    Attributes:
        bytes: saved-activation bytes by destination: ``"keep"``, ``"host"``, ``"peer:<j>"``.
        recompute_forwards: block forwards run under recomputation (first pass; MPress).
        recompute_reruns: block forwards re-run in backward (MPress).
        swapped_in: bytes brought back for backward.
        fallbacks: tensors meant for a peer pool that went to the host because the region was full.
    """

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recompute_forwards: int = 0
    recompute_reruns: int = 0
    swapped_in: int = 0
    fallbacks: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        self.bytes = defaultdict(int)
        self.recompute_forwards = self.recompute_reruns = self.swapped_in = self.fallbacks = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (picklable, JSON-friendly)."""
        return {"bytes": dict(self.bytes), "recompute_forwards": self.recompute_forwards,
                "recompute_reruns": self.recompute_reruns, "swapped_in": self.swapped_in, "fallbacks": self.fallbacks}


class RegionAllocatorLike:  # pragma: no cover - documentation of the protocol only
    """What a peer region's allocator offers (``strategies.mpress.ipc.RegionAllocator``)."""

    def alloc(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` free bytes, or None when full."""

    def free(self, offset: int, nbytes: int) -> None:
        """Give back what :meth:`alloc` returned."""


def _dense(t: torch.Tensor) -> bool:
    # A permutation of a contiguous layout: empty_strided of the same strides re-creates it
    # with exactly numel elements, so a swapped copy can be restored with identical strides.
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _live_slot(group: "SwapGroup", key: tuple) -> "_Slot | None":
    """The slot ``group`` swapped under ``key`` while its storage still lives (not a dead one's
    address reused: the tensor a saver was given may be a view that died since), else None."""
    seen = group.keys.get(key)
    return None if seen is None or seen[0].expired() else seen[1]()


class _Resource:
    """The swap destination of one saved tensor; released once autograd drops the handle."""

    def __init__(self, dst: torch.Tensor, release: Callable[[], None], out_event: Any) -> None:
        self.dst = dst
        self.release_fn = release
        self.out_event = out_event
        self.in_event: Any = None

    def release(self) -> None:
        # The destination may be reused by the next swap-out: both copies must be finished.
        for ev in (self.out_event, self.in_event):
            if ev is not None:
                ev.synchronize()
        self.dst = None
        self.release_fn()


class _Slot:
    """The handle autograd keeps for a swapped tensor.

    ``where`` is the destination really used (a full peer region falls back to the host);
    ``on_fetch`` holds callbacks run each time a copy back starts (profiling only; None otherwise).
    """

    __slots__ = ("shape", "stride", "dtype", "nbytes", "res", "fetched", "where", "on_fetch", "users", "__weakref__")

    def __init__(self, t: torch.Tensor, res: _Resource, where: str = "host") -> None:
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.res = res
        self.fetched: torch.Tensor | None = None
        self.where = where
        self.on_fetch: list[Callable[[], None]] | None = None
        # saved variables packed to this handle whose unpack has not come yet (the first saver's
        # here): the restored copy is given up at the last, so a tensor saved by several ops comes back once
        self.users = 1
        weakref.finalize(self, res.release)


class _View:
    """The handle of a non-dense saved view: its storage's :class:`_Slot` and where in it the view lies."""

    __slots__ = ("slot", "dtype", "offset", "shape", "stride")

    def __init__(self, slot: _Slot, t: torch.Tensor) -> None:
        self.slot, self.dtype, self.offset = slot, t.dtype, t.storage_offset()
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())

    def on(self, storage_bytes: torch.Tensor) -> torch.Tensor:
        """This view rebuilt on ``storage_bytes`` (the restored storage, as contiguous uint8)."""
        return storage_bytes.view(self.dtype).as_strided(self.shape, self.stride, self.offset)


class SwapGroup:
    """The swapped tensors of one block for one forward.

    Attributes:
        destination: ``"host"`` or a peer device index.
        prev: the group swapped just before (backward meets it next): look-ahead follows it.
        on_saved: called with the bytes of every saved tensor that is not skipped (profiling).
    """

    def __init__(self, destination: "str | int", prev: "SwapGroup | None" = None,
                 on_saved: Callable[[int], None] | None = None) -> None:
        self.destination = destination
        self.prev = prev
        self.on_saved = on_saved
        self.slots: list[weakref.ref] = []
        self.keys: dict[tuple, Any] = {}


class ActivationSwapper:
    """Pack/unpack hooks that swap saved activations (see the module docstring).

    Args:
        backend: the xpu backend.
        device: the device the activations live on.
        peer_regions: peer device -> uint8 buffer of this process's region in its pool.
        allocators: peer device -> allocator of that region (``alloc``/``free`` by offset).
        params: tensors never swapped (parameters are not activations).
        min_bytes: saved tensors smaller than this stay on the device.
        stats: where bytes are counted (a fresh :class:`SwapStats` by default).
    """

    def __init__(self, backend: Any, device: int, *, peer_regions: dict[int, torch.Tensor] | None = None,
                 allocators: dict[int, Any] | None = None, params: list[torch.Tensor] | None = None,
                 min_bytes: int = 1024, stats: SwapStats | None = None) -> None:
        self.backend = backend
        self.device = device
        self.peer_regions = dict(peer_regions or {})
        self.allocators = dict(allocators or {})
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in (params or [])}
        self.min_bytes = int(min_bytes)
        self.stats = stats if stats is not None else SwapStats()
        self._out_stream: Any = None
        self._in_stream: Any = None

    # ------------------------------------------------------------------ public
    def skip(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays on the device whatever the decision (a parameter, or small)."""
        return t.untyped_storage().data_ptr() in self._param_ptrs or t.numel() * t.element_size() < self.min_bytes

    @contextlib.contextmanager
    def hooks(self, group: SwapGroup) -> Iterator[SwapGroup]:
        """Swap what autograd saves inside this context into ``group``'s destination."""
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(group, t), self.unpack):
            yield group

    @staticmethod
    def destination_of(packed: Any) -> str:
        """Where the tensor behind a :meth:`pack` result waits for backward.

        ``"host"`` or ``"peer:<j>"`` (the destination really used), or ``"keep"`` (left on the device).
        """
        packed = packed.slot if isinstance(packed, _View) else packed
        return packed.where if isinstance(packed, _Slot) else "keep"

    @staticmethod
    def watch_fetch(packed: Any, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the swapped tensor behind ``packed`` starts coming back.

        For profiling (when a tensor re-occupies device memory); a no-op for a tensor kept on
        the device. Unwatched handles cost nothing: the swapper checks one attribute per fetch.
        """
        packed = packed.slot if isinstance(packed, _View) else packed
        if isinstance(packed, _Slot):
            if packed.on_fetch is None:
                packed.on_fetch = []
            packed.on_fetch.append(callback)

    def prefetch(self, group: SwapGroup | None, lookahead: int = 0) -> None:
        """Start bringing ``group`` (and ``lookahead`` earlier groups) back to the device."""
        for _ in range(lookahead + 1):
            if group is None:
                return
            for ref in group.slots:
                slot = ref()
                if slot is not None:
                    self._fetch(slot)
            group = group.prev

    # ------------------------------------------------------------------ hooks
    def pack(self, group: SwapGroup, t: torch.Tensor) -> Any:
        """Pack hook: swap ``t``'s storage out once however many saved tensors view it (a
        tensor and its reshape, a permutation, slices), rebuilding each view on the restored
        bytes; a dense part of a larger storage not swapped already goes alone. Kept when skipped."""
        if self.skip(t):
            return t.detach()
        if group.on_saved is not None:
            group.on_saved(t.numel() * t.element_size())
        storage = t.untyped_storage()
        size = t.element_size()
        whole_key = (storage.data_ptr(), storage.nbytes())
        if _dense(t) and t.numel() * size < storage.nbytes() and _live_slot(group, whole_key) is None:
            # The same tensor saved by several ops is swapped once.
            key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            return self._swap(group, key, t, t)
        if storage.nbytes() % size:  # not a whole number of elements: not rebuilt as a view, kept
            self.stats.bytes["keep"] += t.numel() * size
            return t.detach()
        # the whole storage as bytes, by views alone (no kernel touches it on the compute stream)
        whole = t.detach().as_strided((storage.nbytes() // size,), (1,), 0).view(torch.uint8)
        return _View(self._swap(group, whole_key, t, whole), t)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Unpack hook: the tensor back on the device, the compute stream ordered after its copy."""
        view = packed if isinstance(packed, _View) else None
        slot = view.slot if view is not None else packed
        if not isinstance(slot, _Slot):
            return packed
        self._fetch(slot)
        out = slot.fetched
        if out is None:
            raise RuntimeError("a swapped activation was read after its swap buffer was released")
        # The compute stream must not read the tensor before the prefetch copy lands.
        self.backend.current_stream(self.device).wait_event(slot.res.in_event)
        self.backend.keep_alive(out, self.backend.current_stream(self.device))
        # At the last user, drop our reference so the restored copy dies with the autograd node
        # that uses it (a later unpack of the same handle fetches it again).
        slot.users -= 1
        if slot.users <= 0:
            slot.fetched = None
        return view.on(out) if view is not None else out

    # ------------------------------------------------------------------ internals
    def _swap(self, group: SwapGroup, key: tuple, saved: torch.Tensor, t: torch.Tensor) -> _Slot:
        """The slot holding ``t`` (the saved tensor ``saved`` itself, or its storage's bytes) at
        ``group``'s destination: the one made under ``key`` while the storage it was made from
        lives, else a new swap-out."""
        slot = _live_slot(group, key)
        if slot is not None:  # the same bytes, swapped already
            slot.users += 1
            return slot
        nbytes = t.numel() * t.element_size()
        out_stream, _ = self._streams()
        compute = self.backend.current_stream(self.device)
        dst, release, where = self._destination(group.destination, t)
        # A permuted tensor is made contiguous by a kernel on the compute stream first.
        src = t.detach() if t.is_contiguous() else t.detach().contiguous()
        # The producer kernels (t's, then the contiguous copy's) are queued on the compute
        # stream: order the side-stream copy after them.
        ready = self.backend.event()
        ready.record(compute)
        out_stream.wait_event(ready)
        self.backend.copy(dst, src if src.shape == dst.shape else src.view(dst.shape), stream=out_stream)
        done = self.backend.event()
        done.record(out_stream)
        # What the copy reads is freed when autograd drops it (or, for a permuted tensor's contiguous
        # copy, as soon as this hook returns); its memory must not be reused before the copy ends.
        self.backend.keep_alive(src, out_stream)
        self.stats.bytes[where] += nbytes
        slot = _Slot(t, _Resource(dst, release, done), where)
        group.slots.append(weakref.ref(slot))
        group.keys[key] = (StorageWeakRef(saved.untyped_storage()), weakref.ref(slot))
        return slot

    def _streams(self) -> tuple[Any, Any]:
        if self._out_stream is None:
            self._out_stream = self.backend.stream(self.device)
            self._in_stream = self.backend.stream(self.device)
        return self._out_stream, self._in_stream

    def _destination(self, destination: "str | int", t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None], str]:
        nbytes = t.numel() * t.element_size()
        if destination != "host":
            alloc = self.allocators[destination]
            offset = alloc.alloc(nbytes)
            if offset is not None:
                region = self.peer_regions[destination]
                dst = region[offset:offset + nbytes].view(t.dtype).view(t.shape)
                return dst, (lambda: alloc.free(offset, nbytes)), f"peer:{destination}"
            self.stats.fallbacks += 1  # region full: still correct, on the slower link
        arena = self.backend.host_arena
        dst = arena.empty(t.shape, t.dtype)
        return dst, (lambda: arena.release(dst)), "host"

    def _fetch(self, slot: _Slot) -> None:
        if slot.fetched is not None or slot.res.dst is None:
            return
        _, in_stream = self._streams()
        compute = self.backend.current_stream(self.device)
        # Allocated in the compute stream's pool; the copy waits for compute (earlier users of
        # that memory) and for the swap-out (the source bytes).
        out = torch.empty_strided(slot.shape, slot.stride, dtype=slot.dtype, device=self.backend.device(self.device))
        ready = self.backend.event()
        ready.record(compute)
        in_stream.wait_event(ready)
        in_stream.wait_event(slot.res.out_event)
        # dst holds the tensor in logical (row-major) order; copy_ lays it out in out's strides.
        self.backend.copy(out, slot.res.dst.view(out.shape), stream=in_stream)
        ev = self.backend.event()
        ev.record(in_stream)
        slot.res.in_event = ev
        slot.fetched = out
        self.stats.swapped_in += slot.nbytes
        if slot.on_fetch is not None:
            for callback in slot.on_fetch:
                callback()
