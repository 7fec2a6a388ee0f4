"""The learning-rate schedule: linear warm-up, then constant or cosine decay, a function of the step alone."""
from __future__ import annotations

import math

from .config import OptimizerConfig

__all__ = ["lr_at"]


def lr_at(opt: OptimizerConfig, step: int, total: int) -> float:
    """Learning rate of update number ``step`` (0-based) out of ``total``: warm-up, then constant or cosine.

    A function of the step alone, so a resumed run follows the same schedule.
    """
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))
