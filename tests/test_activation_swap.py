"""The activation swapper's stream contract: every byte a side-stream copy reads stays allocated
until that copy ends, and a swapped tensor comes back equal, with its own strides.

On the cpu backend copies are synchronous, so a broken contract would not corrupt anything here;
these tests record what the swapper asks of the backend instead. (On CUDA, a permuted saved
tensor's contiguous copy was freed while the swap-out still read it: MPress's peer-swap run then
trained differently from the all-kept one, 1.2 % in one embedding gradient, H200, 2026-12-02.)
"""
from __future__ import annotations

import torch

from strategies.activation_swap import ActivationSwapper, SwapGroup


class _Recording:
    """The cpu backend, recording which storages each copy reads and which are kept alive, by stream."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.read: list[tuple[int, int]] = []  # (storage address, id of the copy's stream)
        self.kept: set[tuple[int, int]] = set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def copy(self, dst, src, stream=None):
        """Record what the copy reads on which stream, then copy."""
        self.read.append((src.untyped_storage().data_ptr(), id(stream)))
        self._inner.copy(dst, src, stream)

    def keep_alive(self, tensor, stream):
        """Record the promise (the cpu backend needs none)."""
        self.kept.add((tensor.untyped_storage().data_ptr(), id(stream)))


def _swapped_out(backend, t: torch.Tensor):
    rec = _Recording(backend)
    swapper = ActivationSwapper(rec, 0, min_bytes=0)
    group = SwapGroup("host")
    handle = swapper.pack(group, t)
    return rec, swapper, handle


def test_every_swap_out_source_is_kept_alive_on_the_copy_stream(cpu_backend):
    x = torch.randn(4, 8, 16, device=cpu_backend.device(0))
    for t in (x, x.transpose(-2, -1)):  # contiguous, and permuted (as matmul saves k^T)
        rec, _, handle = _swapped_out(cpu_backend, t)
        assert ActivationSwapper.destination_of(handle) == "host"
        assert len(rec.read) == 1, rec.read
        assert set(rec.read) <= rec.kept, (t.is_contiguous(), rec.read, rec.kept)


def test_a_permuted_tensor_comes_back_equal_with_its_strides(cpu_backend):
    x = torch.randn(4, 8, 16, device=cpu_backend.device(0))
    t = x.transpose(-2, -1)
    _, swapper, handle = _swapped_out(cpu_backend, t)
    back = swapper.unpack(handle)
    assert back.stride() == t.stride() and torch.equal(back, t)
