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

Parameters and tensors below ``min_bytes`` are kept on the device. Every byte is counted by
destination in :class:`SwapStats`, so tests can check that a swap really happened.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

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

    __slots__ = ("shape", "stride", "dtype", "nbytes", "res", "fetched", "where", "on_fetch", "__weakref__")

    def __init__(self, t: torch.Tensor, res: _Resource, where: str = "host") -> None:
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.res = res
        self.fetched: torch.Tensor | None = None
        self.where = where
        self.on_fetch: list[Callable[[], None]] | None = None
        weakref.finalize(self, res.release)


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
        return packed.where if isinstance(packed, _Slot) else "keep"

    @staticmethod
    def watch_fetch(packed: Any, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the swapped tensor behind ``packed`` starts coming back.

        For profiling (when a tensor re-occupies device memory); a no-op for a tensor kept on
        the device. Unwatched handles cost nothing: the swapper checks one attribute per fetch.
        """
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
        """Pack hook: swap ``t`` out (or keep it, when skipped or not densely laid out)."""
        if self.skip(t):
            return t.detach()
        nbytes = t.numel() * t.element_size()
        if group.on_saved is not None:
            group.on_saved(nbytes)
        if not _dense(t):
            self.stats.bytes["keep"] += nbytes
            # detach(): storing the tensor itself would make a node that saves its own output
            # reference its grad_fn, a cycle only the garbage collector frees.
            return t.detach()
        # The same tensor saved by several ops is swapped once. The key holds a weak reference
        # to the tensor: an address alone could be a dead tensor's, reused by a new one.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        seen = group.keys.get(key)
        if seen is not None:
            src_ref, slot_ref = seen
            if src_ref() is t and slot_ref() is not None:
                return slot_ref()
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
        handle = _Slot(t, _Resource(dst, release, done), where)
        group.slots.append(weakref.ref(handle))
        try:
            group.keys[key] = (weakref.ref(t), weakref.ref(handle))
        except TypeError:  # not weak-referenceable: no dedupe, still correct
            pass
        return handle

    def unpack(self, packed: Any) -> torch.Tensor:
        """Unpack hook: the tensor back on the device, the compute stream ordered after its copy."""
        if not isinstance(packed, _Slot):
            return packed
        self._fetch(packed)
        out = packed.fetched
        if out is None:
            raise RuntimeError("a swapped activation was read after its swap buffer was released")
        # The compute stream must not read the tensor before the prefetch copy lands.
        self.backend.current_stream(self.device).wait_event(packed.res.in_event)
        self.backend.keep_alive(out, self.backend.current_stream(self.device))
        # Drop our reference so the restored copy dies with the autograd node that uses it.
        packed.fetched = None
        return out

    # ------------------------------------------------------------------ internals
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
