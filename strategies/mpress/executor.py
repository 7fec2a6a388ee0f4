"""The swap executor: saved-tensor hooks that keep, recompute, host-swap or peer-swap a block.

Decisions are per transformer block (all saved activations of one block share one fate).
For a swapped block the pack hook copies each saved activation, on a side stream, into a
pinned host buffer (host swap) or into this stage's region of a peer device's pool (D2D
swap), and autograd keeps only a small handle, so the device memory is freed when the
forward drops its own references. When backward reaches the block's output, its tensors
(and the previous block's, one block of look-ahead) are prefetched back on another side
stream; the unpack hook makes the compute stream wait for that copy's event, so no kernel
reads a half-written tensor, and the swap-out's event orders the prefetch after it.

With ``profiling`` on, each block's saved bytes are recorded whether it is kept or swapped
(the pack hook sees every saved tensor either way), so a stage whose activations do not fit
its device all kept can still be profiled, with every block host-swapped.

Parameters and tensors below ``min_bytes`` are always kept. Every byte is counted by
destination in :class:`SwapStats`, so tests can check that a decision was really taken.
"""
from __future__ import annotations

import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .ipc import RegionAllocator

__all__ = ["Decision", "SwapStats", "BlockRecord", "StageExecutor"]

_KINDS = ("keep", "recompute", "host", "peer")


@dataclass(frozen=True)
class Decision:
    """What happens to one block's saved activations.

    Attributes:
        kind: ``"keep"``, ``"recompute"``, ``"host"`` or ``"peer"``.
        peer: the peer device index for ``"peer"``, else None.
    """

    kind: str
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown decision {self.kind!r}; valid: {', '.join(_KINDS)}")
        if (self.kind == "peer") != (self.peer is not None):
            raise ValueError("a 'peer' decision needs a peer device index, and only it takes one")

    @classmethod
    def parse(cls, text: "str | Decision") -> "Decision":
        """``"keep"``, ``"recompute"``, ``"host"`` or ``"peer:<j>"`` (a Decision passes through)."""
        if isinstance(text, Decision):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a decision is a string like 'peer:2', got {text!r}")
        kind, _, rest = text.partition(":")
        if kind == "peer":
            if not rest.isdigit():
                raise ValueError(f"peer decision must name a device, e.g. 'peer:2', got {text!r}")
            return cls("peer", int(rest))
        if rest:
            raise ValueError(f"decision {text!r} takes no argument")
        return cls(kind)

    def __str__(self) -> str:
        return f"peer:{self.peer}" if self.kind == "peer" else self.kind


@dataclass
class SwapStats:
    """Bytes and events by destination, since the executor was made (or :meth:`reset`).

    Attributes:
        bytes: saved-activation bytes by destination: ``"keep"``, ``"host"``, ``"peer:<j>"``.
        recompute_forwards: block forwards run under recomputation (first pass).
        recompute_reruns: block forwards re-run in backward.
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


@dataclass
class BlockRecord:
    """What profiling saw of one block for one micro-batch (seconds and bytes)."""

    saved_bytes: int = 0
    tensors: int = 0
    input_bytes: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_end: float = 0.0
    bwd_start: float = 0.0

    @property
    def gap_s(self) -> float:
        """Time from the end of the block's forward to the start of its backward."""
        return max(0.0, self.bwd_start - self.fwd_end)


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
    """The handle autograd keeps for a swapped tensor."""

    __slots__ = ("shape", "stride", "dtype", "nbytes", "res", "fetched", "__weakref__")

    def __init__(self, t: torch.Tensor, res: _Resource) -> None:
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.res = res
        self.fetched: torch.Tensor | None = None
        weakref.finalize(self, res.release)


class _Group:
    """The swapped tensors of one block for one micro-batch."""

    def __init__(self, decision: Decision, prev: "_Group | None") -> None:
        self.decision = decision
        self.prev = prev
        self.slots: list[weakref.ref] = []
        self.keys: dict[tuple, Any] = {}


class StageExecutor:
    """Runs one stage's blocks under their decisions, and profiles them on request.

    Args:
        backend: the process's xpu backend.
        device: this stage's device index.
        decisions: global block index -> :class:`Decision` (or its string); missing blocks are kept.
        params: the stage's parameters (never swapped: they are not activations).
        peer_regions: peer device -> uint8 buffer of this stage's region in that peer's pool
            (from :func:`~strategies.mpress.ipc.import_buffer`).
        min_bytes: saved tensors smaller than this are kept (swapping them costs more than it saves).
        lookahead: how many earlier blocks to prefetch when backward reaches a block.
    """

    def __init__(self, backend: Any, device: int, decisions: dict[int, Any] | None = None, *,
                 params: list[torch.Tensor] | None = None, peer_regions: dict[int, torch.Tensor] | None = None,
                 min_bytes: int = 1024, lookahead: int = 1) -> None:
        self.backend = backend
        self.device = backend.index_of(device)
        self.decisions = {int(k): Decision.parse(v) for k, v in (decisions or {}).items()}
        self.peer_regions = dict(peer_regions or {})
        for b, d in self.decisions.items():
            if d.kind == "peer":
                if d.peer not in self.peer_regions:
                    raise ValueError(f"block {b} is planned to peer {d.peer} but no region on that peer was given")
                if d.peer == self.device:
                    raise ValueError(f"block {b}: a stage cannot swap to its own device {d.peer}")
        self._allocators = {j: RegionAllocator(buf.numel()) for j, buf in self.peer_regions.items()}
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in (params or [])}
        self.min_bytes = int(min_bytes)
        self.lookahead = int(lookahead)
        self.stats = SwapStats()
        self.profiling = False
        self.records: dict[int, list[BlockRecord]] = defaultdict(list)
        self.inflight = 0
        self.max_inflight = 0
        self._last_group: _Group | None = None
        self._out_stream: Any = None
        self._in_stream: Any = None

    # ------------------------------------------------------------------ public
    def decision(self, block: int) -> Decision:
        """The decision for global block ``block`` (keep when unplanned)."""
        return self.decisions.get(block, Decision("keep"))

    def region_peak(self, peer: int) -> int:
        """Most bytes this stage has held at once in its region on ``peer``."""
        return self._allocators[peer].peak

    def begin_forward(self, first_input: torch.Tensor | None = None) -> None:
        """Call at the start of each stage forward (one micro-batch)."""
        self._last_group = None
        if self.profiling:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            if first_input is not None and first_input.requires_grad:
                def done(grad: torch.Tensor) -> None:
                    self.inflight -= 1
                first_input.register_hook(done)

    def run_block(self, index: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run global block ``index`` on ``x`` under its decision."""
        d = self.decision(index)
        record = BlockRecord() if self.profiling else None
        if record is not None:
            record.input_bytes = x.numel() * x.element_size()
            self.records[index].append(record)
            self.backend.synchronize(self.device)
            t0 = time.perf_counter()
        if d.kind == "recompute" and torch.is_grad_enabled():
            out = self._recompute(block, x)
        elif d.kind in ("host", "peer") and torch.is_grad_enabled():
            group = _Group(d, self._last_group)
            self._last_group = group
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack_swap(group, t, record), self._unpack_swap):
                out = block(x)
            if out.requires_grad:
                out.register_hook(lambda g, group=group: self._on_backward(group, g))
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack_keep(record, t), lambda t: t):
                out = block(x)
        if record is not None:
            self.backend.synchronize(self.device)
            record.fwd_end = time.perf_counter()
            record.fwd_s = record.fwd_end - t0
            if out.requires_grad:
                out.register_hook(lambda g, r=record: self._mark_bwd_start(r, g))
            if x.requires_grad:
                x.register_hook(lambda g, r=record: self._mark_bwd_end(r, g))
        return out

    # ------------------------------------------------------------------ keep / profile
    def _skip(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._param_ptrs or t.numel() * t.element_size() < self.min_bytes

    def _pack_keep(self, record: BlockRecord | None, t: torch.Tensor) -> torch.Tensor:
        if not self._skip(t):
            nbytes = t.numel() * t.element_size()
            self.stats.bytes["keep"] += nbytes
            if record is not None:
                record.saved_bytes += nbytes
                record.tensors += 1
        # detach(): storing the tensor itself would make a node that saves its own output
        # reference its grad_fn, a cycle only the garbage collector frees.
        return t.detach()

    def _mark_bwd_start(self, record: BlockRecord, grad: torch.Tensor) -> None:
        self.backend.synchronize(self.device)
        record.bwd_start = time.perf_counter()

    def _mark_bwd_end(self, record: BlockRecord, grad: torch.Tensor) -> None:
        self.backend.synchronize(self.device)
        record.bwd_s = time.perf_counter() - record.bwd_start

    # ------------------------------------------------------------------ recompute
    def _recompute(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.stats.recompute_forwards += 1
        calls = [0]

        def run(inp: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 1:
                self.stats.recompute_reruns += 1
            return block(inp)

        return checkpoint(run, x, use_reentrant=False)

    # ------------------------------------------------------------------ swap
    def _streams(self) -> tuple[Any, Any]:
        if self._out_stream is None:
            self._out_stream = self.backend.stream(self.device)
            self._in_stream = self.backend.stream(self.device)
        return self._out_stream, self._in_stream

    def _destination(self, decision: Decision, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None], str]:
        nbytes = t.numel() * t.element_size()
        if decision.kind == "peer":
            alloc = self._allocators[decision.peer]
            offset = alloc.alloc(nbytes)
            if offset is not None:
                region = self.peer_regions[decision.peer]
                dst = region[offset:offset + nbytes].view(t.dtype).view(t.shape)
                return dst, (lambda: alloc.free(offset, nbytes)), f"peer:{decision.peer}"
            self.stats.fallbacks += 1  # region full: still correct, on the slower link
        arena = self.backend.host_arena
        dst = arena.empty(t.shape, t.dtype)
        return dst, (lambda: arena.release(dst)), "host"

    def _pack_swap(self, group: _Group, t: torch.Tensor, record: BlockRecord | None = None) -> Any:
        if record is not None and not self._skip(t):
            # Counted as _pack_keep counts (every saved tensor, before de-duplication), so a
            # profile taken with the block swapped reads the same sizes as one taken with it kept.
            record.saved_bytes += t.numel() * t.element_size()
            record.tensors += 1
        if self._skip(t) or not _dense(t):
            return self._pack_keep(None, t)
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
        dst, release, where = self._destination(group.decision, t)
        # The producer kernel is queued on the compute stream: order the copy after it.
        ready = self.backend.event()
        ready.record(compute)
        out_stream.wait_event(ready)
        src = t.detach() if t.is_contiguous() else t.detach().contiguous()
        self.backend.copy(dst, src if src.shape == dst.shape else src.view(dst.shape), stream=out_stream)
        done = self.backend.event()
        done.record(out_stream)
        # The source is freed when autograd drops it; its memory must not be reused before the copy ends.
        self.backend.keep_alive(t, out_stream)
        self.stats.bytes[where] += t.numel() * t.element_size()
        handle = _Slot(t, _Resource(dst, release, done))
        group.slots.append(weakref.ref(handle))
        try:
            group.keys[key] = (weakref.ref(t), weakref.ref(handle))
        except TypeError:  # not weak-referenceable: no dedupe, still correct
            pass
        return handle

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

    def _prefetch_group(self, group: _Group | None) -> None:
        if group is None:
            return
        for ref in group.slots:
            slot = ref()
            if slot is not None:
                self._fetch(slot)

    def _on_backward(self, group: _Group, grad: torch.Tensor) -> None:
        self._prefetch_group(group)
        g = group.prev
        for _ in range(self.lookahead):
            if g is None:
                break
            self._prefetch_group(g)
            g = g.prev
        return None

    def _unpack_swap(self, packed: Any) -> torch.Tensor:
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
