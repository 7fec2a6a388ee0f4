"""Blocks run through ``torch.compile`` (``MemFerry(compile_blocks=True)``; off by default).

Why: a decoder layer run eagerly launches every elementwise op on its own and pays the host's
time to issue each (session 54, one Qwen2-1.5B layer on an H100, 4 x 2048 tokens: forward +
backward 7.07 ms eager, 5.20 compiled; with peft LoRA adapters 8.18 and 5.64;
``bench/results/2026-12-07-h100-session54/call3/``). Inside MemFerry's steps on the DESIGN §3
GPT, whose blocks are large GEMMs, it bought 1.1 % (``bench/results/2026-12-07-h100-session55/``).

What the executor relies on holds for a compiled block (``bench/scripts/probe_compile_block.py``):
moving a parameter's ``.data`` (``UnitShadow.bind``) compiles nothing new, ``checkpoint`` and
selective recomputation recompute through the same graph, saved-tensor hooks see the compiled
graph's saves (so the profiler measures its activations as they are), gradient hooks fire, and
blocks of one class share one graph. A deep copy's ``forward`` attribute, though, is still the
original's compiled method: the profiler compiles its own copy (:func:`compile_forward`).

Blocks whose linears are read over the link (DHA, custom autograd functions over host memory)
or whose activations are offloaded stay eager (:func:`compiles`); the profile measures each
block both ways and the cost model prices a block as it will run (:func:`block_as_run`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import UnitPlan

if TYPE_CHECKING:
    from .profiler import BlockProfile, StepProfile

__all__ = ["compile_forward", "compiles", "block_as_run", "compiled_note"]


def compile_forward(module: nn.Module) -> None:
    """Make ``module.forward`` (its own attribute, else the class's, bound) ``torch.compile``'s
    wrapper of it, for fixed shapes (``dynamic=False``: a new shape compiles once more)."""
    module.forward = torch.compile(module.forward, dynamic=False)


def compiles(plan: UnitPlan) -> bool:
    """Whether a block under ``plan`` runs compiled when blocks are: not where its linears are
    read over the link (``dha`` either way) nor where its activations are offloaded."""
    return "dha" not in (plan.forward, plan.backward) and not plan.offload


def block_as_run(profile: "StepProfile", index: int, plan: UnitPlan) -> "BlockProfile":
    """Block ``index``'s figures as it runs under ``plan``: its eager ones where the profile was
    taken compiled but the block stays eager (:func:`compiles`), else the profile's own."""
    if profile.eager_blocks and not compiles(plan):
        return profile.eager_blocks[index]
    return profile.blocks[index]


def compiled_note(profile: "StepProfile") -> str | None:
    """What compiling bought the profiled blocks, as a plan note: their forward + backward, summed
    over the blocks, compiled against eager (None for a profile taken eagerly). Where the blocks'
    time goes to large GEMMs compiling buys little (session 55: the DESIGN §3 GPT's block 4.45 ms
    compiled, 4.50 eager); where it goes to issuing small kernels, more (a LoRA layer, session 54)."""
    if not profile.eager_blocks:
        return None
    compiled = sum(b.fwd_s + b.bwd_s for b in profile.blocks)
    eager = sum(b.fwd_s + b.bwd_s for b in profile.eager_blocks)
    return (f"compiled blocks: forward + backward {compiled * 1e3:.2f} ms over {len(profile.blocks)} blocks, "
            f"{eager * 1e3:.2f} ms eager ({eager / compiled:.2f}x)" if compiled > 0 else None)
