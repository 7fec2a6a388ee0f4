"""The activation swapper's stream contract: every byte a side-stream copy reads is written before
it is read and stays allocated until that copy ends, and a swapped tensor comes back equal, with
its own strides.

On the cpu backend copies are synchronous, so a broken contract would not corrupt anything here;
``tests/stream_recording.StreamCheck`` orders what the swapper asks of streams as a device would
and lists the breaches instead. (On CUDA, a permuted saved tensor's contiguous copy was freed
while the swap-out still read it, and the swap-out's event was recorded before that copy was
made: MPress's peer-swap run then trained differently from the all-kept one, 1.2 % in one
embedding gradient, H200, 2026-12-02.)
"""
from __future__ import annotations

import pytest
import torch

from strategies.activation_swap import ActivationSwapper, SwapGroup
from tests.stream_recording import StreamCheck


def _swapped_out(backend, t: torch.Tensor):
    swapper = ActivationSwapper(backend, 0, min_bytes=0)
    handle = swapper.pack(SwapGroup("host"), t)
    return swapper, handle


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_a_swap_out_and_back_keeps_the_stream_contract(cpu_backend, permuted):
    """Swap out (a permuted tensor, as matmul saves k^T, is made contiguous by a kernel first),
    drop the source as autograd does, bring it back, use it, release the handle."""
    with StreamCheck(cpu_backend) as check:
        x = torch.randn(4, 8, 16)
        t = x.transpose(-2, -1) if permuted else x
        want = t.clone()
        swapper, handle = _swapped_out(check, t)
        del x, t
        assert ActivationSwapper.destination_of(handle) == "host"
        back = swapper.unpack(handle)
        assert torch.equal(back * 1, want)
        del handle, back
    assert check.breaches == []


def test_a_permuted_tensor_comes_back_equal_with_its_strides(cpu_backend):
    x = torch.randn(4, 8, 16, device=cpu_backend.device(0))
    t = x.transpose(-2, -1)
    swapper, handle = _swapped_out(cpu_backend, t)
    back = swapper.unpack(handle)
    assert back.stride() == t.stride() and torch.equal(back, t)
