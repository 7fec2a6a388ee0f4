"""The multi-path benchmark's measuring parts: byte patterns and checks, timed transfers, solo links.

Used by :mod:`bench.transfers.multipath`; every figure here is a median of wall (or event)
times, and a figure whose bytes failed the check carries no GB/s at all.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

import xpu
from xpu.timing import median_event_seconds
from scaleup import Transfer, TransferEngine

__all__ = ["POISON", "fill_pattern", "verify_bytes", "auto_chunk", "fmt_size", "gbps", "time_transfers",
           "summarize", "ratio", "failed", "measure_links"]

KiB, MiB, GiB = 2**10, 2**20, 2**30
#: Destinations (and the read-back buffer) are filled with this byte before every transfer, so
#: bytes a copier never wrote cannot pass as copied. The source pattern never contains a word
#: of it (see :func:`fill_pattern`).
POISON = 0x5A


# ---------------------------------------------------------------------------------- data
def fill_pattern(buf: torch.Tensor, salt: int) -> torch.Tensor:
    """Fill uint8 ``buf`` with a pattern unique per 8-byte position and per ``salt``; return it.

    Word ``i`` holds ``i + 1 + salt * 2**40``: a chunk written at the wrong offset, a chunk
    missing, or another device's data (another salt) all differ from the source. Words stay
    below ``2**56`` (top byte zero), so no word equals the poison word. A tail of fewer than 8
    bytes gets ``0xA5``.
    """
    n = buf.numel()
    words = n // 8
    if words:
        w = buf[:words * 8].view(torch.int64)
        torch.arange(1, words + 1, dtype=torch.int64, out=w)  # written in place: no 1 GiB temporary
        w.add_(int(salt) << 40)
    if n % 8:
        buf[words * 8:].fill_(0xA5)
    return buf


def verify_bytes(engine: TransferEngine, device: int, dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor) -> dict[str, Any]:
    """Copy device tensor ``dst`` back into host ``scratch`` and compare it byte for byte with ``src``.

    The read-back goes through the engine's device→host path, independent of the host→device
    routes under test; ``scratch`` is poisoned first so a read-back that moved nothing cannot
    pass on stale contents.

    Returns:
        ``{"ok": True}`` or ``{"ok": False, "bad_bytes": n, "first_bad_offset": i,
        "expected": byte, "got": byte}``.
    """
    n = src.numel()
    back = scratch[:n]
    back.fill_(POISON)
    engine.d2h(dst, out=back, device=device).synchronize()
    if torch.equal(back, src):
        return {"ok": True}
    bad = (back != src).nonzero()
    first = int(bad[0, 0]) if bad.numel() else -1
    return {"ok": False, "bad_bytes": int(bad.shape[0]), "first_bad_offset": first,
            "expected": int(src[first]) if first >= 0 else None, "got": int(back[first]) if first >= 0 else None}


def auto_chunk(size: int) -> int:
    """The copier's chunk for a transfer of ``size``: at least 16 chunks, 64 KiB to 8 MiB, a power of two.

    A fixed 8 MiB chunk would give a 64 MiB transfer 8 chunks for 8 routes (one each: no room
    to learn or balance) and a 1 MiB smoke run a single chunk (no relay could carry a byte).
    """
    target = max(1, size // 16)
    return max(64 * KiB, min(8 * MiB, 1 << (target.bit_length() - 1)))


def fmt_size(n: int) -> str:
    """``n`` bytes as ``"4 MiB"``: the largest binary unit that divides it, else plain bytes."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def gbps(nbytes: float, seconds: float) -> float:
    """``nbytes`` over ``seconds`` in GB/s (10**9 B/s), two decimals."""
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------- timing
def _sync_all(backend: xpu.Backend, devices: Sequence[int]) -> None:
    for d in devices:
        backend.synchronize(d)


def time_transfers(backend: xpu.Backend, devices: Sequence[int], issue: Callable[[], list[Transfer]],
                    poison: Callable[[], None], repeats: int, warmup: int = 1) -> tuple[list[float], list[list[Transfer]]]:
    """Per-repeat wall seconds from issuing ``issue()`` until every transfer it returned is done.

    Before each repeat the destinations are poisoned and ``devices`` synchronised, outside the
    timing, so every repeat starts from idle devices and must write every byte again.

    Returns:
        The timed repeats' seconds and their transfer handles (warm-up excluded).

    Raises:
        TransferError: a transfer failed.
    """
    times, handles = [], []
    for i in range(warmup + repeats):
        poison()
        _sync_all(backend, devices)
        t0 = time.perf_counter()
        issued = issue()
        for h in issued:
            h.synchronize()
        _sync_all(backend, devices)  # the host saw completion; nothing may still be landing
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            handles.append(issued)
    return times, handles


def summarize(times: Sequence[float], nbytes: int, check: dict[str, Any]) -> dict[str, Any]:
    """GB/s of the median time, unless the bytes were wrong: then no number at all."""
    med = statistics.median(times)
    return {"GBps": gbps(nbytes, med) if check["ok"] else None,
            "best_GBps": gbps(nbytes, min(times)) if check["ok"] else None,
            "median_s": round(med, 6), "min_s": round(min(times), 6),
            "times_s": [round(t, 6) for t in times], "verified": check}


def ratio(base: Mapping[str, Any] | None, faster: Mapping[str, Any]) -> float | None:
    """``base`` time over ``faster`` time, or None if either has no (verified) figure."""
    if not base or base.get("GBps") is None or faster.get("GBps") is None:
        return None
    return round(base["median_s"] / faster["median_s"], 3)


def failed(exc: BaseException) -> dict[str, Any]:
    """The figure of a configuration whose transfer raised ``exc``: no GB/s, the error named."""
    return {"GBps": None, "best_GBps": None, "error": f"{type(exc).__name__}: {exc}", "verified": {"ok": False, "error": str(exc)}}


# ---------------------------------------------------------------------------------- solo links
def measure_links(backend: xpu.Backend, targets: Sequence[int], nbytes: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each link alone, raw ``backend.copy`` timed with events: every device's host link, and
    every peer→``targets`` link the copier may relay over.

    These calibrate the ``measured_links`` prediction
    (:func:`bench.transfers.multipath_report.calibrated_topology`).
    """
    b, n = backend, backend.device_count()
    progress(f"solo links ({fmt_size(nbytes)} each)")
    src = b.host_arena.empty(nbytes)
    src.fill_(1)
    h2d: dict[str, float] = {}
    for d in range(n):
        dst, s = b.empty(nbytes, torch.uint8, d), b.stream(d)
        h2d[str(d)] = gbps(nbytes, median_event_seconds(b, s, lambda: b.copy(dst, src, s)))
        dst = None  # freed now (the timed lambda names it: rebound, not deleted)
    b.host_arena.release(src)
    peer: dict[str, float] = {}
    if b.caps.peer_access:
        for t in targets:
            for p in range(n):
                if p == t or not b.can_access_peer(p, t) or not b.enable_peer_access(p, t):
                    continue
                with b.device_scope(p):  # torch issues a peer copy from the source device
                    a, s = b.empty(nbytes, torch.uint8, p), b.stream(p)
                c = b.empty(nbytes, torch.uint8, t)
                with b.device_scope(p):
                    peer[f"{p}->{t}"] = gbps(nbytes, median_event_seconds(b, s, lambda: b.copy(c, a, s)))
                del a, c
    return {"size_bytes": nbytes, "h2d_GBps": h2d, "peer_GBps": peer}

