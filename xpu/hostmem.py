"""Anonymous host mappings for the backends' pinned buffers, on huge pages by default, and the
host memory Linux says is available (:func:`mem_available`, for checks before pinning).

Why a mapping of our own: a page-aligned mapping per buffer registers (pins) and unregisters
on its own, exactly sized (see ``backends/cuda.py``).

Why huge pages by default (``XPU_HOST_HUGEPAGES=0`` turns them off): a 6.58 B model's shadow pins
about 98 GB. On 4 KiB pages of a shared mapping, making it took 72 s on an H100 host, and the
kernel's compaction meanwhile tried and failed to migrate the pinned pages, sending up to 265 k
TLB shootdowns a second to the process's cores. On 2 MiB pages it took 29-30 s with no such storm,
and the host AdamW ran at the same rate (bench/results/2026-12-06-h100-session38/). Each mapping
is private: shared anonymous memory is shmem, which takes huge pages only where
``shmem_enabled`` allows ("never" by default), and whose pinned pages compaction does not skip
(it skips pinned private anonymous pages). Each is advised ``MADV_HUGEPAGE`` before it is registered
(so it is faulted in as 2 MiB pages where transparent huge pages are ``madvise`` or ``always``;
elsewhere the advice is a no-op), and advised ``MADV_DONTFORK``: a forked child (a DataLoader
worker) must not share a private pinned mapping copy-on-write, which would either copy every
pinned page at the fork or leave the device reading pages the parent no longer owns.
"""
from __future__ import annotations

import mmap
import os

import torch

__all__ = ["in_host_memory", "mem_available", "anonymous_mapping", "mapped_buffer", "huge_pages_wanted", "advise_huge_pages", "advise_dont_fork",
           "transparent_huge_pages", "HUGE_PAGE_BYTES", "ENV"]

#: The environment variable for huge pages: ``1`` or unset (advise them), ``0`` (4 KiB pages of a
#: shared mapping, as before session 38).
ENV = "XPU_HOST_HUGEPAGES"
#: Size of one transparent huge page on x86-64 and (4 KiB-granule) arm64.
HUGE_PAGE_BYTES = 2 << 20


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether torch places ``t`` in host memory (pinned or not).

    On the cpu backend every virtual device's tensors are host tensors too, so this says where
    the bytes live as torch sees them, not which of the backend's devices owns them.
    """
    return t.device.type == "cpu"


def mem_available() -> int | None:
    """Bytes Linux estimates can be allocated without swapping (``MemAvailable`` in
    /proc/meminfo), or None where the file or the field is missing."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode, the bracketed word of
    /sys/kernel/mm/transparent_hugepage/enabled (``always``, ``madvise`` or ``never``): under
    ``never`` the advice does nothing and pinned buffers take 4 KiB pages. None where the file is
    missing (not Linux, or a kernel without them)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            text = fh.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_wanted() -> bool:
    """Whether pinned buffers should be on huge pages: ``XPU_HOST_HUGEPAGES`` is ``1`` or unset.

    Raises:
        ValueError: the variable holds something other than ``0`` or ``1``.
    """
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV} must be 1 (huge pages for pinned host buffers, the default) or 0 (4 KiB pages), got {value!r}")
    return value != "0"


def _advise(mapping: mmap.mmap, name: str) -> bool:
    """Advise ``mmap.<name>`` on the whole of ``mapping``; False where this Python or kernel cannot."""
    advice = getattr(mmap, name, None)
    if advice is None or not hasattr(mapping, "madvise"):
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # e.g. a kernel built without transparent huge pages
        return False
    return True


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Advise ``MADV_HUGEPAGE`` on ``mapping``; False where this Python or kernel cannot."""
    return _advise(mapping, "MADV_HUGEPAGE")


def advise_dont_fork(mapping: mmap.mmap) -> bool:
    """Advise ``MADV_DONTFORK`` on ``mapping`` (a forked child does not inherit it); False where
    this Python or kernel cannot."""
    return _advise(mapping, "MADV_DONTFORK")


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous mapping of ``nbytes`` bytes (> 0). Where :func:`huge_pages_wanted`
    (the default): private, kept out of forked children, and advised onto huge pages where it
    spans at least one; else shared (``XPU_HOST_HUGEPAGES=0``). Touch or register it after this
    call: the advice applies to pages faulted in afterwards."""
    if nbytes <= 0:
        raise ValueError(f"anonymous_mapping needs a positive size, got {nbytes}")
    if not huge_pages_wanted():
        return mmap.mmap(-1, nbytes)
    # Private, not mmap's default shared mapping: shared anonymous memory is shmem, whose huge
    # pages follow shmem_enabled ("never" by default: H200 machine, 2026-12-01, AnonHugePages
    # stayed 0 kB), and whose pinned pages compaction tries to move (the module docstring).
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_dont_fork(mapping)
    if nbytes >= HUGE_PAGE_BYTES:
        advise_huge_pages(mapping)
    return mapping


def mapped_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An :func:`anonymous_mapping` of ``nbytes`` bytes and a uint8 tensor over it, every page
    already faulted in, ready to register. Why fault first: the kernel zeroes each page on the
    thread that faults it, and registering faults them all on the one calling thread; written by
    torch's intra-op pool instead, 16 GiB of huge pages pinned in 0.87 s against 2.82 s (H200 host,
    16 cores: bench/results/2026-12-06-h200-session39/call1/pinning.txt), so a 98 GB shadow's
    buffers take seconds less to make. The tensor keeps the mapping alive (``torch.frombuffer``)."""
    mapping = anonymous_mapping(nbytes)
    buf = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    buf.zero_()  # a write faults each page in (a read would map the shared zero page)
    return mapping, buf
