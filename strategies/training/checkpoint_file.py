"""A checkpoint file's bytes: streamed out, mapped back in, never serialised in memory.

Layout (format 3)::

    <B bytes: torch.save of {"engine": ..., "data": ..., "config": ..., "dtype": ...}>   # a zip from byte 0
    {"format": 3, "run_id": "...", "step": N, "time": T, "bytes": B, "crc32": C}<spaces>\\nXPUCKPT3\\n
                                                       # the header: the file's last TRAILER bytes

``torch.save`` writes straight into the file through :class:`_Checksummed`, which takes the
CRC-32 and the length as the bytes pass; the header is written last, so a file cut short has
none. Reading checks the CRC in ``_CHUNK``-sized reads, then ``torch.load(mmap=True)`` maps the
payload: a tensor's bytes are read from the file when it is used (a copy into an engine's own
buffers), and the pages are the page cache's, not the process's. Why: the state of a model that
does not fit its device is the host's largest object (a 6.6 B-parameter MemFerry run holds
~105 GB of fp32 masters and moments). Serialising it to memory first, as format 2's writer did,
needed that much again to save (a ``BytesIO`` and its ``getvalue()`` copy) and to resume (the
payload's bytes beside the tensors made from them); and each ``xpu mpress`` stage, which needs
only its own tensors, held every stage's.

Format 2 (``XPUCKPT\\n``, a JSON line, then the payload) still reads, streamed from its offset.
"""
from __future__ import annotations

import io
import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["TRAILER", "write_streamed", "parse_header", "verify_streamed", "load_payload"]

#: Bytes of the header at a format-3 file's end, its end marker included (the JSON is ~150 bytes).
TRAILER = 512
_END = b"\nXPUCKPT3\n"
_MAGIC2 = b"XPUCKPT\n"  # format 2's first bytes
_HEADER2_MAX = 4096
_ZIP = b"PK\x03\x04"  # what torch.save's zip starts with
_CHUNK = 8 << 20  # bytes per read while checking the CRC: memory held, not a throughput knob
_KEYS = ("run_id", "step", "time", "bytes", "crc32")


class _Checksummed:
    """A write-only file object for ``torch.save``: passes bytes on, keeping their CRC-32 and count."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.crc, self.bytes = f, 0, 0
        self.error: OSError | None = None  # torch reports a failed write as a short one; this says why

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.bytes += view.nbytes
        try:
            done = 0
            while done < view.nbytes:  # a short write (a disk filling up) is retried until it fails
                done += self.f.write(view[done:])
        except OSError as exc:
            self.error = exc
            raise
        return done

    def flush(self) -> None:
        self.f.flush()


class _Window(io.RawIOBase):
    """The file ``f`` from ``start`` on, as a file of its own (``torch.load`` seeks from 0)."""

    def __init__(self, f: io.BufferedReader, start: int) -> None:
        super().__init__()
        self.f, self.start = f, start
        f.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        return self.f.seek(pos + self.start if whence == io.SEEK_SET else pos, whence) - self.start

    def tell(self) -> int:
        return self.f.tell() - self.start

    def readinto(self, buffer: Any) -> int:
        return self.f.readinto(buffer)


def write_streamed(path: Path, payload: dict[str, Any], header: Callable[[int, int], dict[str, Any]]) -> None:
    """Write ``torch.save(payload)``, then the header ``header(payload_bytes, crc32)`` (a JSON
    object) as the file's last ``TRAILER`` bytes, and fsync the file. Memory held beyond
    ``payload``: torch's write buffers, not the payload's bytes."""
    with open(path, "wb") as f:
        out = _Checksummed(f)
        try:
            torch.save(payload, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None  # "no space left on device", not torch's "unexpected pos"
            raise
        line = json.dumps(header(out.bytes, out.crc)).encode()
        if len(line) > TRAILER - len(_END):
            raise ValueError(f"a checkpoint header must fit {TRAILER - len(_END)} bytes, got {len(line)}")
        f.write(line.ljust(TRAILER - len(_END)) + _END)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint


def parse_header(path: Path) -> dict[str, Any]:
    """The header of a format-3 or format-2 file, with ``_start`` and ``_end`` (None: the file's
    end) bounding its payload.

    Raises:
        OSError: the file cannot be read.
        EOFError: empty, or cut short (the message says which).
        ValueError: not a checkpoint of a format this version reads (the message says why).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC2) + _HEADER2_MAX)
        if not head:
            raise EOFError("is empty (0 bytes): the write was cut off")
        if head.startswith(_ZIP):
            f.seek(max(0, size - TRAILER))
            tail = f.read(TRAILER)
            if len(tail) < TRAILER or not tail.endswith(_END):
                raise EOFError("is truncated: its header, written last, is missing")
            header, start, end = _fields(tail[: -len(_END)], 3), 0, size - TRAILER
        elif head.startswith(_MAGIC2):
            stop = head.find(b"\n", len(_MAGIC2))
            if stop < 0:
                raise ValueError("truncated inside its header")
            header, start, end = _fields(head[len(_MAGIC2):stop], 2), stop + 1, None
        elif _MAGIC2.startswith(head) or _ZIP.startswith(head):
            raise EOFError("is truncated inside its first bytes")
        else:
            raise ValueError("no xpu train header (formats 2 and 3)")
    return {**header, "_start": start, "_end": end}


def _fields(raw: bytes, fmt: int) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError("its header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != fmt:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'} where its layout is "
                         f"format {fmt}")
    missing = [k for k in _KEYS if k not in header]
    if missing:
        raise ValueError(f"header lacks {missing[0]!r}")
    return header


def verify_streamed(path: Path, start: int, end: int | None) -> tuple[int, int]:
    """``(bytes, crc32)`` of the file from ``start`` to ``end`` (None: its end), read ``_CHUNK`` bytes at a time."""
    crc, count = 0, 0
    left = (end - start) if end is not None else None
    with open(path, "rb") as f:
        f.seek(start)
        chunk = bytearray(_CHUNK)
        view = memoryview(chunk)
        while left is None or left > 0:
            n = f.readinto(view if left is None or left >= _CHUNK else view[:left])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            count += n
            left = None if left is None else left - n
    return count, crc


def load_payload(path: Path, start: int, end: int | None) -> Any:
    """``torch.load(weights_only=True)`` of the payload: a format-3 file mapped (tensors read
    from the file where used), a format-2 one read record by record from ``start``."""
    if start == 0 and end is not None:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except OSError:  # a file system that cannot map files: read it as format 2's are
            pass
    with open(path, "rb") as f:
        return torch.load(_Window(f, start), map_location="cpu", weights_only=True)
