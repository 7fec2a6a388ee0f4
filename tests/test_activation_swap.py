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


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "permuted part"])
def test_a_swap_out_and_back_keeps_the_stream_contract(cpu_backend, layout):
    """Swap out (a permuted tensor, as matmul saves k^T, goes as its storage's bytes; a permuted
    part of a larger storage is made contiguous by a kernel first), drop the source as autograd
    does, bring it back, use it, release the handle."""
    with StreamCheck(cpu_backend) as check:
        x = torch.randn(8 if layout == "permuted part" else 4, 8, 16)
        t = {"contiguous": x, "permuted": x.transpose(-2, -1), "permuted part": x[:4].transpose(-2, -1)}[layout]
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


def _split_heads_attention(qkv: torch.Tensor) -> torch.Tensor:
    """q, k, v as slices of one fused projection's output (views that are not dense), saved by a matmul."""
    q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
    return ((q @ k.transpose(-2, -1)).softmax(-1) @ v).sum()


def test_slices_of_one_storage_swap_it_once_and_free_the_device(cpu_backend):
    """The slices of a fused qkv output: their storage leaves the device once for all of them
    (before, non-dense views stayed, and with them the whole storage), and backward's gradient
    equals the one without swapping."""
    b = cpu_backend
    with b.device_scope(0):
        x = torch.randn(2, 16, 96, device=b.device(0), generator=torch.Generator().manual_seed(0))
        w = torch.randn(96, 288, device=b.device(0), generator=torch.Generator().manual_seed(1), requires_grad=True)
        want = torch.autograd.grad(_split_heads_attention(x @ w), w)[0]
        swapper = ActivationSwapper(b, 0, min_bytes=1024, params=[w])
        group = SwapGroup("host")
        before = b.memory_stats(0).allocated
        with swapper.hooks(group):
            loss = _split_heads_attention(x @ w)
        held = b.memory_stats(0).allocated - before
        qkv_bytes = 2 * 16 * 288 * 4
        # one swap of the qkv storage (its three slices), and every other saved tensor
        assert len([r for r in group.slots if r() is not None and r().nbytes == qkv_bytes]) == 1
        assert swapper.stats.bytes.get("keep", 0) == 0
        assert held < qkv_bytes  # the storage is not held on the device between the passes
        swapper.prefetch(group)
        got = torch.autograd.grad(loss, w)[0]
    assert swapper.stats.swapped_in == swapper.stats.bytes["host"]
    assert torch.equal(got, want)


def _probs_times_values(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax saves its output; the matmul after it saves a reshape of that output (eager
    attention in Gemma 2 and others): two saved tensors, one storage."""
    p = scores.softmax(-1)
    return (p.reshape(-1, *p.shape[-2:]) @ v).sum()


def test_a_tensor_and_its_reshape_swap_their_storage_once(cpu_backend):
    """Before, each dense saved tensor was swapped under its own shape: the softmax output went
    out twice and came back twice (Gemma 2's offloaded blocks 1.08x their predicted peak)."""
    b = cpu_backend
    with b.device_scope(0):
        g = torch.Generator().manual_seed(0)
        scores = torch.randn(4, 4, 64, 64, device=b.device(0), generator=g, requires_grad=True)
        v = torch.randn(16, 64, 16, device=b.device(0), generator=g, requires_grad=True)
        want = torch.autograd.grad(_probs_times_values(scores, v), (scores, v))
        swapper = ActivationSwapper(b, 0, min_bytes=1024, params=[v])
        group = SwapGroup("host")
        with swapper.hooks(group):
            loss = _probs_times_values(scores, v)
        probs_bytes = 4 * 4 * 64 * 64 * 4
        assert swapper.stats.bytes["host"] == probs_bytes  # the probabilities once (v is a parameter here)
        swapper.prefetch(group)
        got = torch.autograd.grad(loss, (scores, v))
    assert swapper.stats.swapped_in == probs_bytes
    assert all(torch.equal(a, w) for a, w in zip(got, want))
