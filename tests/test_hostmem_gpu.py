"""Pinned host buffers on an accelerator (``pytest -m gpu``): by default private, kept from forked
children, and copied both ways; shared with ``XPU_HOST_HUGEPAGES=0`` (``xpu/hostmem.py``). Whether
the kernel gave huge pages depends on its free memory, so it is not asserted here:
``bench/scripts/diag_pinning.py`` counts them (``thp_fault_alloc``)."""
from __future__ import annotations

import os

import pytest
import torch

from xpu import hostmem
from test_hostmem import mapped_in_child, smaps_at

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")]

MIB = 1 << 20


def test_pinned_buffers_are_private_unforked_and_copy_both_ways(gpu_backend, monkeypatch):
    monkeypatch.delenv(hostmem.ENV, raising=False)
    buf = gpu_backend.alloc_pinned(16 * MIB)
    assert buf.is_pinned()
    sharing, flags = smaps_at(buf.data_ptr())
    assert sharing == "p" and "dc" in flags
    host = buf.view(torch.float32)
    host.copy_(torch.arange(host.numel(), dtype=torch.float32))
    back = gpu_backend.to_device(host, 0).mul_(2).cpu()
    assert torch.equal(back, torch.arange(host.numel(), dtype=torch.float32) * 2)
    assert not mapped_in_child(buf.data_ptr())  # a forked DataLoader worker cannot touch it
    gpu_backend.free_pinned(buf)


def test_the_opt_out_pins_shared_pages(gpu_backend, monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "0")
    buf = gpu_backend.alloc_pinned(4 * MIB)
    assert buf.is_pinned() and smaps_at(buf.data_ptr())[0] == "s"
    gpu_backend.free_pinned(buf)
