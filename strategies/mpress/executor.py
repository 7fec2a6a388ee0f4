"""The swap executor: saved-tensor hooks that keep, recompute, host-swap or peer-swap a block.

The swapping itself is ``strategies/activation_swap.py`` (shared with MemFerry's activation
offload); this module decides per block and profiles.

Decisions are per transformer block (all saved activations of one block share one fate).
For a swapped block the pack hook copies each saved activation, on a side stream, into a
pinned host buffer (host swap) or into this stage's region of a peer device's pool (D2D
swap), and autograd keeps only a small handle, so the device memory is freed when the
forward drops its own references. When backward reaches the block's output, its tensors
(and the previous block's, one block of look-ahead) are prefetched back on another side
stream; the unpack hook makes the compute stream wait for that copy's event, so no kernel
reads a half-written tensor, and the swap-out's event orders the prefetch after it.

With ``profiling`` on, each block's saved bytes are recorded whether it is kept, swapped or
recomputed (the pack hook sees every saved tensor either way), so a stage whose activations
do not fit its device all kept can still be profiled, with every block host-swapped. With
``trace_tensors`` also on (the default), every saved tensor gets a :class:`TensorRecord`:
its size, shape, dtype, producing op, the backward node that reads it, and when it was
saved, brought back and read. The tracing wraps the decision's own hooks only while
profiling; outside the profiled iteration no per-tensor work is added.

Parameters and tensors below ``min_bytes`` are always kept. Every byte is counted by
destination in :class:`SwapStats`, so tests can check that a decision was really taken.
"""
from __future__ import annotations

import re
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..activation_swap import ActivationSwapper, SwapGroup, SwapStats
from .ipc import RegionAllocator

__all__ = ["Decision", "SwapStats", "BlockRecord", "TensorRecord", "StageExecutor"]

_KINDS = ("keep", "recompute", "host", "peer")
#: The suffix autograd gives backward nodes (``AddmmBackward0``): dropped to name the forward op.
_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")
#: Private torch hooks the tracer uses, looked up once; without them it degrades (see TensorRecord).
_current_node = getattr(torch._C, "_current_autograd_node", None)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


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
class TensorRecord:
    """One saved activation of one block and micro-batch, as the profiled iteration saw it.

    Times are host seconds since the profiled iteration began (:meth:`StageExecutor.restart_clock`):
    when autograd's pack / unpack hook ran. On an accelerator the host runs ahead of its
    kernels by at most one block (profiling synchronizes at block boundaries).

    Attributes:
        block: global block index.
        microbatch: micro-batch index within the iteration.
        index: its place among the block's saved tensors of that micro-batch (save order).
        nbytes: its size (elements x element size; a view counts its own elements).
        shape: its shape.
        dtype: its dtype without the ``torch.`` prefix (``"float32"``).
        producer: the forward op that made its bytes: its ``grad_fn`` without the
            ``Backward<n>`` suffix (``"Addmm"``, ``"Gelu"``, ``"NativeLayerNorm"``); a view is
            named by its base's op (the op that owns the memory, not ``"View"``). Without
            history: ``"leaf"`` for a tensor that requires grad (a stage's received input),
            ``"input"`` for one outside autograd (data, a mask, or a non-differentiable
            output such as layer-norm statistics).
        consumer: the backward node that read it (``"AddmmBackward0"``), from
            ``torch._C._current_autograd_node()`` in the unpack hook; ``""`` if backward never
            read it, ``"?"`` if it was read outside a backward node.
        where: what the block's decision did with it: ``"keep"``, ``"recompute"``, ``"host"`` or
            ``"peer:<j>"`` (the destination really used: a full peer region falls back to
            ``"host"``; a swapped block's tensor the swapper keeps, a parameter or one below its
            ``min_bytes``, reads ``"keep"``).
        pack_s: when forward saved it.
        unpack_s: when backward got it back (after any recomputation); None if never.
        fetch_s: when it re-occupied device memory before use: for a swapped tensor when its
            copy back began (prefetch, or on demand); for a recomputed one when the
            recomputation in backward re-created it; None when kept.
        alias_of: ``index`` of an earlier record of the same block and micro-batch that is the
            same tensor saved by another op (its bytes exist once; a swap moves them once).
    """

    block: int
    microbatch: int
    index: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    producer: str
    consumer: str = ""
    where: str = "keep"
    pack_s: float = 0.0
    unpack_s: float | None = None
    fetch_s: float | None = None
    alias_of: int | None = None

    @property
    def lifetime_s(self) -> float | None:
        """Seconds from being saved in forward to being read in backward (None if never read)."""
        return None if self.unpack_s is None else self.unpack_s - self.pack_s

    @property
    def resident_s(self) -> float | None:
        """Seconds it held device memory while saved: the whole lifetime when kept; from its
        copy back or recomputation to its use otherwise (the swap-out copy itself not counted)."""
        if self.unpack_s is None:
            return None
        if self.where == "keep":
            return self.unpack_s - self.pack_s
        return None if self.fetch_s is None else self.unpack_s - self.fetch_s


@dataclass
class BlockRecord:
    """What profiling saw of one block for one micro-batch (seconds and bytes).

    ``saved`` holds the per-tensor records when tensors are traced; their ``nbytes`` add up
    to ``saved_bytes`` (both count a tensor saved by several ops once per op).
    """

    saved_bytes: int = 0
    tensors: int = 0
    input_bytes: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_end: float = 0.0
    bwd_start: float = 0.0
    saved: list[TensorRecord] = field(default_factory=list)

    @property
    def gap_s(self) -> float:
        """Time from the end of the block's forward to the start of its backward."""
        return max(0.0, self.bwd_start - self.fwd_end)


def _producer(t: torch.Tensor) -> str:
    """The forward op that made ``t``'s bytes (see :attr:`TensorRecord.producer`)."""
    src = t._base if t._is_view() and t._base is not None else t
    fn = src.grad_fn
    if fn is None:
        return "leaf" if src.requires_grad else "input"
    name = fn.name()
    return _BACKWARD_SUFFIX.sub("", name) or name


class _Traced:
    """What a tracing pack hook hands autograd: the record (None: not traced) and the decision's own handle."""

    __slots__ = ("rec", "packed")

    def __init__(self, rec: TensorRecord | None, packed: Any) -> None:
        self.rec, self.packed = rec, packed


class _Tracer:
    """Per-tensor profiling of one block's forward for one micro-batch.

    Wraps the decision's pack / unpack hooks (it chains to them, since autograd uses only the
    innermost pair): records each saved tensor that is not skipped, names its consumer in the
    unpack hook, and for swapped tensors watches the copy back. For a recomputed block it
    wraps the checkpoint's own hooks; its re-run saves the same tensors in the same order
    (checkpoint itself relies on that), which dates each tensor's re-creation.

    ``trace`` False only counts bytes (recomputed blocks, whose tensors no other hook sees).
    """

    def __init__(self, executor: "StageExecutor", block: int, microbatch: int, record: BlockRecord, where: str,
                 trace: bool = True, count: bool = False) -> None:
        self.ex, self.block, self.microbatch, self.record = executor, block, microbatch, record
        self.where, self.trace, self.count = where, trace, count
        self.order: list[TensorRecord | None] = []  # every pack, skipped ones as None (recompute matching)
        self.keys: dict[tuple, tuple[weakref.ref, int]] = {}
        self.remat = 0

    def _now(self) -> float:
        return time.perf_counter() - self.ex.origin

    def pack(self, t: torch.Tensor, inner: Callable[[torch.Tensor], Any]) -> _Traced:
        """Record ``t`` (unless skipped), then pack it with ``inner``, the decision's own hook."""
        if self.ex.swapper.skip(t):
            self.order.append(None)
            return _Traced(None, inner(t))
        nbytes = t.numel() * t.element_size()
        if self.count:
            self.record.saved_bytes += nbytes
            self.record.tensors += 1
        if not self.trace:
            self.order.append(None)
            return _Traced(None, inner(t))
        rec = TensorRecord(self.block, self.microbatch, len(self.record.saved), nbytes, tuple(t.shape),
                           str(t.dtype).removeprefix("torch."), _producer(t), where=self.where, pack_s=self._now())
        # An address alone could be a dead tensor's, reused: the key keeps a weak reference to check.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        seen = self.keys.get(key)
        if seen is not None and seen[0]() is t:
            rec.alias_of = seen[1]
        else:
            try:
                self.keys[key] = (weakref.ref(t), rec.index)
            except TypeError:  # not weak-referenceable: no alias detection, records still right
                pass
        self.record.saved.append(rec)
        self.order.append(rec)
        packed = inner(t)
        if self.where != "recompute":
            rec.where = self.ex.swapper.destination_of(packed)
            if rec.where != "keep":
                self.ex.swapper.watch_fetch(packed, lambda rec=rec: self._fetched(rec))
        return _Traced(rec, packed)

    def unpack(self, traced: _Traced, inner: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """Unpack with ``inner``; the first read dates the record and names the node reading it."""
        out = inner(traced.packed)
        rec = traced.rec
        if rec is not None and rec.unpack_s is None:
            rec.unpack_s = self._now()
            node = _current_node() if _current_node is not None else None
            rec.consumer = node.name() if node is not None else "?"
        return out

    def recomputed(self, t: torch.Tensor, inner: Callable[[torch.Tensor], Any]) -> Any:
        """Pack hook of the recomputation: the k-th tensor saved now is the k-th saved in forward."""
        k = self.remat
        self.remat += 1
        rec = self.order[k] if k < len(self.order) else None
        if rec is not None:
            rec.fetch_s = self._now()
        return inner(t)  # may stop the recomputation early (checkpoint raises past here)

    def _fetched(self, rec: TensorRecord) -> None:
        # A tensor saved by two ops is fetched again for the second read: keep, per record,
        # the last copy back before its own read.
        if rec.unpack_s is None:
            rec.fetch_s = self._now()


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
        stage: the index ``peer:<j>`` decisions number this stage by (None: ``device``); it
            differs from the device when stages share devices (a job's ``devices`` map).
    """

    def __init__(self, backend: Any, device: int, decisions: dict[int, Any] | None = None, *,
                 params: list[torch.Tensor] | None = None, peer_regions: dict[int, torch.Tensor] | None = None,
                 min_bytes: int = 1024, lookahead: int = 1, stage: int | None = None) -> None:
        self.backend = backend
        self.device = backend.index_of(device)
        self.stage = self.device if stage is None else int(stage)
        self.decisions = {int(k): Decision.parse(v) for k, v in (decisions or {}).items()}
        self.peer_regions = dict(peer_regions or {})
        for b, d in self.decisions.items():
            if d.kind == "peer":
                if d.peer not in self.peer_regions:
                    raise ValueError(f"block {b} is planned to peer {d.peer} but no region on that peer was given")
                if d.peer == self.stage:
                    raise ValueError(f"block {b}: a stage cannot swap to its own device (peer {d.peer} is this stage)")
        self._allocators = {j: RegionAllocator(buf.numel()) for j, buf in self.peer_regions.items()}
        self.min_bytes = int(min_bytes)
        self.lookahead = int(lookahead)
        self.stats = SwapStats()
        self.swapper = ActivationSwapper(backend, self.device, peer_regions=self.peer_regions, allocators=self._allocators,
                                         params=params, min_bytes=min_bytes, stats=self.stats)
        self._profiling = False
        #: Per-tensor records while profiling (:class:`TensorRecord`); off, only per-block sums.
        self.trace_tensors = True
        #: ``time.perf_counter()`` at the start of the profiled iteration: tensor times count from it.
        self.origin = time.perf_counter()
        self.records: dict[int, list[BlockRecord]] = defaultdict(list)
        self.inflight = 0
        self.max_inflight = 0
        self._last_group: SwapGroup | None = None

    # ------------------------------------------------------------------ public
    @property
    def profiling(self) -> bool:
        """Whether blocks are profiled (:class:`BlockRecord`, and :class:`TensorRecord` with ``trace_tensors``)."""
        return self._profiling

    @profiling.setter
    def profiling(self, on: bool) -> None:
        if on and not self._profiling:
            self.origin = time.perf_counter()
        self._profiling = bool(on)

    def restart_clock(self) -> None:
        """Make now time 0 of the tensor records (call just before the profiled iteration)."""
        self.origin = time.perf_counter()

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
        grad = torch.is_grad_enabled()
        tracer: _Tracer | None = None
        if record is not None:
            record.input_bytes = x.numel() * x.element_size()
            self.records[index].append(record)
            kind = d.kind if grad else "keep"
            # Recomputed blocks need the tracer even untraced: no other hook of theirs counts bytes.
            if grad and (self.trace_tensors or kind == "recompute"):
                tracer = _Tracer(self, index, len(self.records[index]) - 1, record,
                                 "recompute" if kind == "recompute" else "keep",
                                 trace=self.trace_tensors, count=kind == "recompute")
            self.backend.synchronize(self.device)
            t0 = time.perf_counter()
        if d.kind == "recompute" and grad:
            out = self._recompute(block, x, tracer)
        elif d.kind in ("host", "peer") and grad:
            group = SwapGroup("host" if d.kind == "host" else d.peer, self._last_group,
                              on_saved=self._saved_counter(record))
            self._last_group = group
            if tracer is None:
                with self.swapper.hooks(group):
                    out = block(x)
            else:
                swapper = self.swapper
                with torch.autograd.graph.saved_tensors_hooks(
                        lambda t: tracer.pack(t, lambda u: swapper.pack(group, u)),
                        lambda p: tracer.unpack(p, swapper.unpack)):
                    out = block(x)
            if out.requires_grad:
                out.register_hook(lambda g, group=group: self._on_backward(group, g))
        elif tracer is None:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack_keep(record, t), lambda t: t):
                out = block(x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: tracer.pack(t, lambda u: self._pack_keep(record, u)),
                    lambda p: tracer.unpack(p, _identity)):
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
    def _saved_counter(self, record: BlockRecord | None) -> Callable[[int], None] | None:
        # Counted as _pack_keep counts (every saved tensor, before de-duplication), so a
        # profile taken with the block swapped reads the same sizes as one taken with it kept.
        if record is None:
            return None

        def count(nbytes: int) -> None:
            record.saved_bytes += nbytes
            record.tensors += 1
        return count

    def _pack_keep(self, record: BlockRecord | None, t: torch.Tensor) -> torch.Tensor:
        if not self.swapper.skip(t):
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
    def _recompute(self, block: nn.Module, x: torch.Tensor, tracer: _Tracer | None = None) -> torch.Tensor:
        self.stats.recompute_forwards += 1
        calls = [0]

        def run(inp: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 1:
                self.stats.recompute_reruns += 1
            # The checkpoint's hooks are the innermost pair here; a tracer must chain to them.
            top = _top_hooks(False) if tracer is not None and _top_hooks is not None else None
            if top is None:
                return block(inp)
            inner_pack, inner_unpack = top
            if calls[0] == 1:
                hooks = (lambda t: tracer.pack(t, inner_pack), lambda p: tracer.unpack(p, inner_unpack))
            else:
                hooks = (lambda t: tracer.recomputed(t, inner_pack), inner_unpack)
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                return block(inp)

        return checkpoint(run, x, use_reentrant=False)

    # ------------------------------------------------------------------ swap
    def _on_backward(self, group: SwapGroup, grad: torch.Tensor) -> None:
        self.swapper.prefetch(group, self.lookahead)
        return None


def _identity(t: Any) -> Any:
    return t
