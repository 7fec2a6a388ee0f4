"""How the profiler times a block's passes, and why a cold device's first figures are timed again.

A forward is timed as the training thread issues it, alone (events around it: the device also
waits for each launch, as it does behind Python in a step); a backward, and a forward as
recomputation runs it inside backward, issued ahead (``xpu.timing.pipelined_seconds``: the
device is first kept busy for twice the pass's host time of the round before and a
millisecond, so the host issues the whole pass before the device reaches it; the longer of the
device's and the host's time), as autograd issues them in a step. Each figure is the median of
``repeats`` rounds after one that warms kernels and the allocator.

The first figures of a process on a device machine just started can still run slow, past that
warm-up: on an H100 started for the call (session 40) the first row's profile took 17.4 s
against 4.6 s for the next row's, and timed the HF block's backward at 6.80 ms against 4.38 ms;
its plan was priced 17 % over what its rehearsal then measured (3.081 against 2.633 s). Times
only err upward that way, so the profiler times the first distinct block and then the ``rest``
unit again once everything else is measured, and keeps the lesser of each figure
(:func:`lesser_times`).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
from torch import nn

from xpu import Backend
from xpu.timing import pipelined_seconds

__all__ = ["LEAD_FACTOR", "LEAD_MIN_S", "timed", "timed_passes", "lesser_times", "TIME_FIELDS"]

#: A pass timed issued ahead waits behind LEAD_FACTOR x its host time of the round before, plus
#: LEAD_MIN_S, of device work: room for the host to issue all of it before the device reaches it.
LEAD_FACTOR = 2.0
LEAD_MIN_S = 1e-3
#: A ``BlockProfile``'s timings (seconds); the rest of its fields are bytes and counts.
TIME_FIELDS = ("fwd_s", "bwd_s", "recompute_s", "bwd_selective_s", "fwd_selective_s")


def timed(backend: Backend, device: int, fn: Callable[[], None],
          host_before: float | None = None) -> tuple[float, float]:
    """(seconds of ``fn``, seconds the host spent issuing it). ``host_before`` None: alone, the
    device time read with events around ``fn``; else issued ahead (see the module docstring),
    behind a lead sized from ``host_before``, the host time of the same pass the round before.
    Virtual devices run work as it is issued: there both ways are the plain reading."""
    ahead = host_before is not None and not backend.caps.virtual_devices
    lead = LEAD_FACTOR * host_before + LEAD_MIN_S if ahead else 0.0
    dev_s, host_s = pipelined_seconds(backend, device, backend.current_stream(device), fn, lead)
    return (max(dev_s, host_s) if ahead else dev_s), host_s


def timed_passes(backend: Backend, device: int, blk: nn.Module, forward: Callable[[], Any],
                 grads: list[torch.Tensor], repeats: int) -> tuple[float, float, float]:
    """Median forward (alone), backward (issued ahead) and recomputation (the forward issued
    ahead) times of ``forward()`` over ``repeats`` rounds, after one that warms up kernels and
    the allocator and gives each pass's host time (:func:`timed`)."""
    fwd, bwd, again = [], [], []
    host_f = host_b = 0.0
    for i in range(repeats + 1):
        for p in blk.parameters():
            p.grad = None
        holder: list[Any] = []
        f, host_f = timed(backend, device, lambda: holder.append(forward()))
        outs = [t for t in torch.utils._pytree.tree_leaves(holder[0])
                if isinstance(t, torch.Tensor) and t.requires_grad]
        b, host_b = timed(backend, device, lambda: torch.autograd.backward(outs, grads), host_b if i else None)
        if i:
            r, _ = timed(backend, device, forward, host_f)  # recomputation records a graph too
            fwd.append(f)
            bwd.append(b)
            again.append(r)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(again)


def lesser_times(first: Any, again: Any) -> Any:
    """``first`` (a ``BlockProfile``) with each of its :data:`TIME_FIELDS` lowered to ``again``'s
    where that is less (see the module); its bytes are kept. Changes ``first`` and returns it."""
    for name in TIME_FIELDS:
        setattr(first, name, min(getattr(first, name), getattr(again, name)))
    return first
