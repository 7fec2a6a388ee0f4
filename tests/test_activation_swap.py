"""The activation swapper's stream contract: every byte a side-stream copy reads stays allocated
until that copy ends, and a swapped tensor comes back equal, with its own strides.

On the cpu backend copies are synchronous, so a broken contract would not corrupt anything here;
these tests record what the swapper asks of the backend instead. (On CUDA, a permuted saved
tensor's contiguous copy was freed while the swap-out still read it: MPress's peer-swap run then
trained differently from the all-kept one, 1.2 % in one embedding gradient, H200, 2026-12-02.)
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from strategies.activation_swap import ActivationSwapper, SwapGroup


class _Recording:
    """The cpu backend, recording which storages each copy reads and which are kept alive, by stream."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.read: list[tuple[int, int]] = []  # (storage address, id of the copy's stream)
        self.kept: set[tuple[int, int]] = set()
        self.log: list[str] = []  # what happened, in order: "copy", "record on compute", "record elsewhere"

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def copy(self, dst, src, stream=None):
        """Record what the copy reads on which stream, then copy."""
        self.read.append((src.untyped_storage().data_ptr(), id(stream)))
        self.log.append("copy")
        self._inner.copy(dst, src, stream)

    def event(self, timing: bool = False):
        """An event whose records are logged (on the compute stream or elsewhere)."""
        return _LoggedEvent(self, self._inner.event(timing))

    def keep_alive(self, tensor, stream):
        """Record the promise (the cpu backend needs none)."""
        self.kept.add((tensor.untyped_storage().data_ptr(), id(stream)))


class _LoggedEvent:
    def __init__(self, rec: _Recording, inner) -> None:
        self._rec, self._inner = rec, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def record(self, stream=None):
        compute = self._rec.current_stream(0)
        self._rec.log.append("record on compute" if stream is compute else "record elsewhere")
        self._inner.record(stream)


class _LogClones(TorchDispatchMode):
    """Logs every kernel that makes a copy of a tensor on the current stream (``contiguous()``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default:
            self.log.append("clone")
        return func(*args, **(kwargs or {}))


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


def test_a_permuted_tensor_is_made_contiguous_before_the_swap_out_copy_waits_on_compute(cpu_backend):
    """The copy stream waits for an event recorded on the compute stream: that event must come after
    the kernel making the contiguous copy, or the side-stream copy can read it half-written."""
    x = torch.randn(4, 8, 16, device=cpu_backend.device(0))
    rec = _Recording(cpu_backend)
    swapper = ActivationSwapper(rec, 0, min_bytes=0)
    assert rec.current_stream(0) is rec.current_stream(0)  # the premise: one compute stream object
    with _LogClones(rec.log):
        swapper.pack(SwapGroup("host"), x.transpose(-2, -1))
    copy = rec.log.index("copy")
    ordering = max(i for i, e in enumerate(rec.log[:copy]) if e == "record on compute")
    assert "clone" in rec.log[:copy] and rec.log.index("clone") < ordering, rec.log
