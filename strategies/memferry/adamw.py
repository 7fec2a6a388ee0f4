"""One AdamW step over a unit's flat fp32 master, with the moments kept in buffers we own."""
from __future__ import annotations

import torch

from .config import AdamW

__all__ = ["flat_adamw"]


def flat_adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
               cfg: AdamW) -> torch.optim.AdamW:
    """torch's fused AdamW over ``master`` whose state *is* ``exp_avg``/``exp_avg_sq``.

    Giving the state up front makes torch use our (pinned or device) buffers instead of
    allocating its own; the step counter lives on the master's device, as fused AdamW wants.
    Set ``master.grad`` before ``step()``.
    """
    opt = torch.optim.AdamW([master], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
    opt.state[master] = {"step": torch.tensor(float(step), device=master.device), "exp_avg": exp_avg,
                         "exp_avg_sq": exp_avg_sq}
    return opt
