"""Tensors as byte ranges, and cutting a tensor group into chunks.

Copies move bytes, so every tensor is viewed as a flat ``uint8`` tensor (any dtype, any size,
0 bytes included). Element order is only defined for contiguous tensors, so non-contiguous
ones are refused with a message saying what to do, before anything is queued.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch

__all__ = ["TensorGroup", "as_group", "byte_view", "Segment", "Chunk", "make_chunks", "check_pairs", "device_outputs"]

#: A tensor or a sequence of tensors (a parameter group).
TensorGroup = Union[torch.Tensor, Sequence[torch.Tensor]]


def as_group(x: TensorGroup, what: str) -> tuple[list[torch.Tensor], bool]:
    """``(tensors, was_single)`` for a tensor or a sequence of tensors.

    Raises:
        TypeError: ``x`` is neither, or holds something that is not a tensor.
    """
    if isinstance(x, torch.Tensor):
        return [x], True
    if isinstance(x, (list, tuple)):
        for i, t in enumerate(x):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        return list(x), False
    raise TypeError(f"{what} must be a tensor or a list/tuple of tensors, got {type(x).__name__}")


def byte_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat uint8 tensor sharing its memory.

    Raises:
        ValueError: ``t`` is not a dense, contiguous, materialised tensor.
    """
    if t.layout != torch.strided:
        raise ValueError(f"{what} has layout {t.layout}; only dense (strided) tensors can be copied")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{what} has a lazy conjugate/negative bit; call .resolve_conj().resolve_neg() first")
    if not t.is_contiguous():
        raise ValueError(
            f"{what} is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}); the transfer engine copies "
            f"byte ranges and will not reorder elements: pass t.contiguous() (or copy into a contiguous buffer) instead"
        )
    return t.reshape(-1).view(torch.uint8)


def check_pairs(src: list[torch.Tensor], dst: list[torch.Tensor], what_src: str = "src", what_dst: str = "out") -> None:
    """Raise ValueError unless ``src`` and ``dst`` pair up in count, shape and dtype."""
    if len(src) != len(dst):
        raise ValueError(f"{what_dst} has {len(dst)} tensors for {len(src)} in {what_src}")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape or s.dtype != d.dtype:
            raise ValueError(
                f"{what_dst}[{i}] is {tuple(d.shape)} {d.dtype} but {what_src}[{i}] is {tuple(s.shape)} {s.dtype}; they must match"
            )


@dataclass
class Segment:
    """A byte range copied in one piece: ``dst`` and ``src`` are equal-length uint8 tensors.

    ``offset`` is where the range sits inside its chunk (for staging buffers).
    """

    src: torch.Tensor
    dst: torch.Tensor
    offset: int


@dataclass
class Chunk:
    """Up to ``chunk_bytes`` of a transfer: one or more segments, possibly of several tensors.

    Attributes:
        index: position in the transfer.
        segments: the byte ranges, back to back.
        nbytes: total bytes.
        pinned: whether every source range is pinned host memory (no host staging needed).
        owner: the route currently responsible for it (set by the copier).
    """

    index: int
    segments: list[Segment]
    nbytes: int
    pinned: bool = True
    owner: str | None = field(default=None, compare=False)


def make_chunks(pairs: Sequence[tuple[torch.Tensor, torch.Tensor, bool]], chunk_bytes: int) -> list[Chunk]:
    """Cut ``(src_bytes, dst_bytes, src_pinned)`` pairs into chunks of at most ``chunk_bytes``.

    Small tensors share a chunk; large ones span several. Empty tensors produce nothing.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[Chunk] = []
    segs: list[Segment] = []
    fill, pinned = 0, True
    for src, dst, src_pinned in pairs:
        n, pos = src.numel(), 0
        while pos < n:
            take = min(n - pos, chunk_bytes - fill)
            segs.append(Segment(src[pos:pos + take], dst[pos:pos + take], fill))
            pinned = pinned and src_pinned
            fill += take
            pos += take
            if fill == chunk_bytes:
                chunks.append(Chunk(len(chunks), segs, fill, pinned))
                segs, fill, pinned = [], 0, True
    if fill:
        chunks.append(Chunk(len(chunks), segs, fill, pinned))
    return chunks


def device_outputs(backend: "Any", srcs: list[torch.Tensor], out: TensorGroup | None, device: int) -> list[torch.Tensor]:
    """Device tensors a host->device transfer of ``srcs`` fills: ``out`` checked against
    ``srcs`` (count, shape, dtype, on the backend's devices), or new ones on ``device``.

    Raises:
        TypeError, ValueError: ``out`` does not match; nothing has been allocated.
    """
    if out is None:
        return [backend.empty(s.shape, s.dtype, device) for s in srcs]
    outs, _ = as_group(out, "out")
    check_pairs(srcs, outs)
    for i, o in enumerate(outs):
        if o.device.type != backend.device_type:
            raise ValueError(f"out[{i}] is on {o.device}, not a {backend.name} device")
    return outs
