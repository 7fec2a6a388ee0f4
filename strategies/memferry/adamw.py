"""One AdamW step over a unit's flat fp32 master, with the moments kept in buffers we own."""
from __future__ import annotations

from typing import Sequence

import torch

from .config import AdamW

__all__ = ["flat_adamw", "decay_ranges", "squared_norm", "squared_norm_sum"]


def flat_adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
               cfg: AdamW, weight_decay: float | None = None) -> torch.optim.AdamW:
    """torch's fused AdamW over ``master`` whose state *is* ``exp_avg``/``exp_avg_sq``.

    Giving the state up front makes torch use our (pinned or device) buffers instead of
    allocating its own; the step counter lives on the master's device, as fused AdamW wants.
    Set ``master.grad`` before ``step()``. ``weight_decay``: overrides ``cfg.weight_decay``
    (0 for the no-decay group).
    """
    wd = cfg.weight_decay if weight_decay is None else weight_decay
    opt = torch.optim.AdamW([master], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=wd, fused=True)
    opt.state[master] = {"step": torch.tensor(float(step), device=master.device), "exp_avg": exp_avg,
                         "exp_avg_sq": exp_avg_sq}
    return opt


def decay_ranges(size: int, decay_end: int, chunk: int | None = None, tail: int = 0) -> list[tuple[int, int, bool]]:
    """``(start, stop, decays)`` covering ``[0, size)``: the decay prefix ``[0, decay_end)`` and the
    no-decay rest, each cut into pieces of at most ``chunk`` elements (None: whole); a group's
    last piece shorter than ``tail`` joins the one before it (then up to ``chunk + tail``)."""
    out = []
    for a0, b0, decays in ((0, decay_end, True), (decay_end, size, False)):
        step = chunk or max(1, b0 - a0)
        cut = [(a, min(a + step, b0), decays) for a in range(a0, b0, step)]
        if len(cut) > 1 and cut[-1][1] - cut[-1][0] < tail:
            cut[-2:] = [(cut[-2][0], b0, decays)]
        out.extend(cut)
    return out


#: Elements per piece of :func:`squared_norm`: where the reduction casts through a temporary
#: (the CPU), it stays at 256 MiB; a GPU block's weight is one piece.
NORM_CHUNK = 1 << 26


def squared_norm(t: torch.Tensor, chunk: int = NORM_CHUNK) -> torch.Tensor:
    """The sum of squares of ``t``, a 0-dim fp64 tensor on ``t``'s device (no sync).

    Each piece is reduced by ``torch.linalg.vector_norm``: a 16-bit gradient accumulating in fp32
    (its squares are exact in fp32; the sum's relative error is about 1e-7, against the 1e-3 of
    ``clip_grad_norm_``'s 16-bit norms), an fp32 one (a sum made on the device) in fp64 as the
    host's loop sums it; the pieces' squares are summed in fp64. One fused
    read of the gradient: summing ``t.double().square()`` in 4 M-element pieces took 12.7 ms of
    device time and 11.5 ms of the training thread's launches per step for 1.0 B bf16 gradients
    on the H200, this 1.2 and 1.0 ms (``bench/scripts/diag_norm.py``, 2026-12-03). Deterministic
    for a given tensor, so every path that norms a unit the same way gets the same bits.
    """
    flat = t.reshape(-1)
    acc = torch.float32 if flat.element_size() < 4 else torch.float64  # fp32 sums (device-summed units) as the host's loop
    if flat.numel() <= chunk:
        return torch.linalg.vector_norm(flat, dtype=acc).double().square()
    return torch.stack([torch.linalg.vector_norm(part, dtype=acc) for part in flat.split(chunk)]).double().square().sum()


def squared_norm_sum(tensors: Sequence[torch.Tensor], chunk: int = NORM_CHUNK) -> torch.Tensor:
    """The sum of squares of every tensor in ``tensors`` (not empty), a 0-dim fp64 tensor on their
    device (no sync), in a fixed number of launches.

    The 16-bit tensors of at most ``chunk`` elements are reduced together by one
    ``torch._foreach_norm`` accumulating in fp32 (one multi-tensor kernel on CUDA, the per-tensor
    ``vector_norm`` of :func:`squared_norm` elsewhere); the rest one by one as
    :func:`squared_norm` does. Launches cost the training thread's time, and the compute stream
    idles when the thread falls behind: three launches per gradient and a stack made the 17-layer
    clipped bench's training thread spend 9.5 ms more per step queuing 7 blocks' gradients home
    (``grad_post_ms_per_step``; gaps of 1.3-2.1 ms at each, H200, 2026-12-03). Deterministic for a
    given list."""
    if not tensors:
        raise ValueError("squared_norm_sum needs at least one tensor")
    fused, parts = [], []
    for t in tensors:
        if t.element_size() < 4 and t.numel() <= chunk:
            fused.append(t)
        else:
            parts.append(squared_norm(t, chunk))
    if fused:
        parts.append(torch.stack(torch._foreach_norm(fused, 2, dtype=torch.float32)).double().square().sum())
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()
