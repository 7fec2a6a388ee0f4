"""One AdamW step over a unit's flat fp32 master, with the moments kept in buffers we own."""
from __future__ import annotations

import torch

from .config import AdamW

__all__ = ["flat_adamw", "decay_ranges", "squared_norm"]


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


def decay_ranges(size: int, decay_end: int, chunk: int | None = None) -> list[tuple[int, int, bool]]:
    """``(start, stop, decays)`` covering ``[0, size)``: the decay prefix ``[0, decay_end)`` and the
    no-decay rest, each cut into pieces of at most ``chunk`` elements (None: whole)."""
    out = []
    for a0, b0, decays in ((0, decay_end, True), (decay_end, size, False)):
        step = chunk or max(1, b0 - a0)
        out.extend((a, min(a + step, b0), decays) for a in range(a0, b0, step))
    return out


#: Elements per piece of :func:`squared_norm`: its fp64 temporaries stay at 2 x 32 MiB.
NORM_CHUNK = 1 << 22


def squared_norm(t: torch.Tensor, chunk: int = NORM_CHUNK) -> torch.Tensor:
    """The sum of squares of ``t`` in fp64, a 0-dim tensor on ``t``'s device (no sync).

    Piece by piece: ``t.double().square()`` of a whole unit made two fp64 temporaries of 8 B
    per element each (1 GiB for a 65 M-parameter embedding on the device, which no plan counts).
    """
    flat = t.reshape(-1)
    if flat.numel() <= chunk:
        return flat.double().square().sum()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for part in flat.split(chunk):
        total += part.double().square().sum()
    return total
