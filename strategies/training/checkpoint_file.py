"""A checkpoint file's bytes, streamed both ways: no serialised copy of the state in memory.

``torch.save`` writes straight into the file through :class:`_Checksummed`, which takes the
CRC-32 and the length as the bytes pass; the header line, reserved at the start as
``HEADER_SLOT`` spaces, is filled in afterwards. Reading checks the CRC in ``_CHUNK``-sized reads,
then ``torch.load`` reads the payload's records from the file through :class:`_Window`. Why: the
state of a model that does not fit its device is the host's largest object (a 6.6 B-parameter
MemFerry run holds ~105 GB of fp32 masters and moments), and serialising it to memory first, as
this layer did, needed that much again to save (a ``BytesIO`` and its ``getvalue()`` copy: up to
twice) and to resume (the payload's bytes beside the tensors made from them).

The layout is format 2's (``checkpoints.py``): a header line padded with spaces is still one JSON
line, so files written before read as they did, and these read where those did.
"""
from __future__ import annotations

import io
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["HEADER_SLOT", "write_streamed", "verify_streamed", "load_streamed"]

#: Bytes reserved for the JSON header line, its newline included (the line is ~150 bytes).
HEADER_SLOT = 512
_CHUNK = 8 << 20  # bytes per read while checking the CRC: memory held, not a throughput knob


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


def write_streamed(path: Path, magic: bytes, payload: dict[str, Any], header: Callable[[int, int], bytes]) -> None:
    """Write ``magic``, then the header line ``header(payload_bytes, crc32)`` (without its newline,
    at most ``HEADER_SLOT - 1`` bytes; padded with spaces), then ``torch.save(payload)``, and
    fsync the file. Memory held beyond ``payload``: torch's write buffers, not the payload's bytes."""
    with open(path, "wb") as f:
        f.write(magic + b" " * (HEADER_SLOT - 1) + b"\n")
        out = _Checksummed(f)
        try:
            torch.save(payload, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None  # "no space left on device", not torch's "unexpected pos"
            raise
        line = header(out.bytes, out.crc)
        if b"\n" in line or len(line) >= HEADER_SLOT:
            raise ValueError(f"a checkpoint header line must be one line under {HEADER_SLOT} bytes, got {len(line)}")
        f.seek(len(magic))
        f.write(line.ljust(HEADER_SLOT - 1))
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint


def verify_streamed(path: Path, start: int) -> tuple[int, int]:
    """``(bytes, crc32)`` of the file from ``start`` to its end, read ``_CHUNK`` bytes at a time."""
    crc, count = 0, 0
    with open(path, "rb") as f:
        f.seek(start)
        chunk = bytearray(_CHUNK)
        view = memoryview(chunk)
        while n := f.readinto(chunk):
            crc = zlib.crc32(view[:n], crc)
            count += n
    return count, crc


def load_streamed(path: Path, start: int) -> Any:
    """``torch.load(weights_only=True)`` of the payload starting at ``start``, read from the file
    record by record (the tensors it makes, not the file's bytes as well)."""
    with open(path, "rb") as f:
        return torch.load(_Window(f, start), map_location="cpu", weights_only=True)
