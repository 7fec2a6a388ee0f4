"""Anonymous host mappings for the backends' pinned buffers, optionally on huge pages, and
the host memory Linux says is available (:func:`mem_available`, for checks before pinning).

Why a mapping of our own: a page-aligned mapping per buffer registers (pins) and unregisters
on its own, exactly sized (see ``backends/cuda.py``). Why huge pages, optionally: the host
optimizer streams tens of GB of pinned buffers per step; with 4 KiB pages that is millions of
page-table entries, and the page walks compete with the data for the CPU's caches. With
``XPU_HOST_HUGEPAGES=1`` each mapping is advised ``MADV_HUGEPAGE`` before it is registered, so
where the kernel's transparent huge pages are ``madvise`` or ``always`` the memory is faulted
in as 2 MiB pages. Off by default until a GPU machine has measured it (see
``bench/scripts/diag_host_rate.py``); where the kernel refuses, the advice is a no-op.
"""
from __future__ import annotations

import mmap
import os

import torch

__all__ = ["in_host_memory", "mem_available", "anonymous_mapping", "huge_pages_wanted", "advise_huge_pages", "HUGE_PAGE_BYTES", "ENV"]

#: The environment variable that asks for huge pages: ``1`` (advise) or ``0``/unset (do not).
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


def huge_pages_wanted() -> bool:
    """Whether ``XPU_HOST_HUGEPAGES`` asks for huge pages.

    Raises:
        ValueError: the variable holds something other than ``0`` or ``1``.
    """
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV} must be 1 (advise huge pages for pinned host buffers) or 0, got {value!r}")
    return value == "1"


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Advise ``MADV_HUGEPAGE`` on ``mapping``; False where this Python or kernel cannot."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mapping, "madvise"):
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # e.g. a kernel built without transparent huge pages
        return False
    return True


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous mapping of ``nbytes`` bytes (> 0), advised onto huge pages when
    :func:`huge_pages_wanted` and it spans at least one huge page. Touch or register it after
    this call: the advice applies to pages faulted in afterwards."""
    if nbytes <= 0:
        raise ValueError(f"anonymous_mapping needs a positive size, got {nbytes}")
    if nbytes >= HUGE_PAGE_BYTES and huge_pages_wanted():
        # Private, not mmap's default shared mapping: shared anonymous memory is shmem, whose
        # huge pages follow shmem_enabled ("never" by default), so the advice did nothing there
        # (H200 machine, 2026-12-01: AnonHugePages stayed 0 kB).
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise_huge_pages(mapping)
        return mapping
    return mmap.mmap(-1, nbytes)
