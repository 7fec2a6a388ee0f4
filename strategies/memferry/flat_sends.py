"""A unit's gradients home in one copy: gathered into one device buffer, sent into one host span.

Sending a block's gradients tensor by tensor costs the issuing thread per tensor (each copy's
runtime call, pinned-memory check and stream bookkeeping): on the H200 one ``copy_many`` of a
block's 12 gradients took 0.27 ms of the thread on an idle device and the whole send 0.45 ms
(``bench/scripts/diag_hook_thread.py``, 2026-12-04), where one copy of a flat buffer of the same
bytes took 0.05-0.06 ms (``diag_grad_post.py``, form ``flat``). A plan summing on the host sends
every block's gradients in every micro-batch, on the thread that issues the step's kernels.

With ``AdamW.flat_sends`` the gradients are first gathered on the device, in one fused copy on
the device→host stream (after the compute that made them, beside the next block's), into a
buffer laid out as their host targets are, and the buffer goes home in one copy. The price: that
fused copy (the unit's gradient bytes read and written once more in device memory, tens of
microseconds off the compute stream) and one unit's gradients more of device memory until the
copy home ends, which the cost model counts in the block's backward transient
(``block_costs.option_cost``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from xpu import Backend

__all__ = ["host_span", "gather"]


def host_span(targets: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view over ``targets`` where there are at least two and they lie back to back, in
    order, in one storage, each contiguous and of one dtype (a unit's slices of its flat host
    gradient buffer); else None (nothing to gain, or no single copy can fill them)."""
    if len(targets) < 2:
        return None
    first = targets[0]
    start = end = first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for t in targets:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != end):
            return None
        end += t.numel()
    return first.as_strided((end - start,), (1,), start)


def gather(backend: Backend, sources: Sequence[torch.Tensor], device: Any, dtype: torch.dtype) -> torch.Tensor:
    """``sources`` copied, in order, into one new flat buffer of ``dtype`` on ``device``, in one
    call on the current stream (a caller sending it from another stream keeps it alive there)."""
    flat = backend.empty(sum(s.numel() for s in sources), dtype, device)
    views = [v.view(s.shape) for v, s in zip(flat.split([s.numel() for s in sources]), sources)]
    backend.copy_many(views, list(sources))
    return flat
