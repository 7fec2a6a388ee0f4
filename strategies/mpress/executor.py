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

With ``profiling`` on, each block's saved bytes are recorded whether it is kept or swapped
(the pack hook sees every saved tensor either way), so a stage whose activations do not fit
its device all kept can still be profiled, with every block host-swapped.

Parameters and tensors below ``min_bytes`` are always kept. Every byte is counted by
destination in :class:`SwapStats`, so tests can check that a decision was really taken.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..activation_swap import ActivationSwapper, SwapGroup, SwapStats
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
        self.min_bytes = int(min_bytes)
        self.lookahead = int(lookahead)
        self.stats = SwapStats()
        self.swapper = ActivationSwapper(backend, self.device, peer_regions=self.peer_regions, allocators=self._allocators,
                                         params=params, min_bytes=min_bytes, stats=self.stats)
        self.profiling = False
        self.records: dict[int, list[BlockRecord]] = defaultdict(list)
        self.inflight = 0
        self.max_inflight = 0
        self._last_group: SwapGroup | None = None

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
            group = SwapGroup("host" if d.kind == "host" else d.peer, self._last_group,
                              on_saved=self._saved_counter(record))
            self._last_group = group
            with self.swapper.hooks(group):
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
    def _on_backward(self, group: SwapGroup, grad: torch.Tensor) -> None:
        self.swapper.prefetch(group, self.lookahead)
        return None
