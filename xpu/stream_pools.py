"""Where a caching allocator's reserved bytes sit, stream by stream.

PyTorch's caching allocators (CUDA's, and the Ascend one built like it) give a freed block back
only to the pool of the stream it was allocated on, and a block freed while another stream
still uses it (``record_stream``) waits for that stream's work before any reuse. So reserved
memory can pass what is in use by what one stream's pool held at its own high point while
another's was elsewhere. The split says which pool holds such a difference: a 128-layer plan
whose rehearsal reserved 15.3 GB in some runs and 16.6-16.7 in others had it all in the compute
stream's pool, 15.0 GB allocated at the peak (H100, session 48): that pool's cache.

:func:`by_stream` reads the allocator's snapshot (the list of segments a backend's
``memory_snapshot()`` gives); :func:`describe` puts the result on one line for a log.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple

from .units import format_bytes

__all__ = ["StreamPool", "by_stream", "describe"]


class StreamPool(NamedTuple):
    """One stream's share of a device's reserved memory, in bytes.

    Attributes:
        reserved: bytes of the segments the stream's pool holds.
        allocated: of those, bytes in live blocks now.
        pending_free: of those, bytes freed but waiting for another stream's work to finish.
    """

    reserved: int
    allocated: int
    pending_free: int


def by_stream(segments: Iterable[Mapping[str, Any]], device: int,
              names: Mapping[int, str] | None = None) -> dict[str, StreamPool]:
    """Sum ``segments`` (an allocator snapshot's) of ``device`` by stream, largest first.

    Args:
        segments: each with ``device``, ``stream`` (the stream's handle), ``total_size``,
            ``allocated_size`` and ``blocks`` (each with ``size`` and ``state``).
        device: the device index to keep.
        names: handle → name for streams the caller knows; handle 0 is "default", any other
            "stream 0x…".
    """
    names = {0: "default", **(names or {})}
    sums: dict[str, list[int]] = {}
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        handle = int(seg.get("stream", 0))
        got = sums.setdefault(names.get(handle, f"stream {handle:#x}"), [0, 0, 0])
        got[0] += int(seg["total_size"])
        got[1] += int(seg.get("allocated_size", 0))
        got[2] += sum(int(b["size"]) for b in seg.get("blocks", ()) if b.get("state") == "active_pending_free")
    return {name: StreamPool(*v) for name, v in sorted(sums.items(), key=lambda kv: -kv[1][0])}


def describe(pools: Mapping[str, StreamPool]) -> str:
    """One line: each stream's reserved bytes, with what is allocated and waiting to be freed
    where not zero (``"compute 16.6 GB (9.7 GB allocated, 906.4 MB pending free), d2h 20.0 MB"``);
    empty where ``pools`` is."""
    parts = []
    for name, p in pools.items():
        extra = [f"{format_bytes(n)} {what}" for n, what in ((p.allocated, "allocated"),
                                                            (p.pending_free, "pending free")) if n]
        parts.append(f"{name} {format_bytes(p.reserved)}" + (f" ({', '.join(extra)})" if extra else ""))
    return ", ".join(parts)
