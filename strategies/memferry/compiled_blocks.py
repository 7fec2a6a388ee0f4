"""Blocks run through ``torch.compile`` (``MemFerry(compile_blocks=True)``; off by default).

Why: a decoder layer run eagerly launches every elementwise op on its own and pays the host's
time to issue each (session 54, one Qwen2-1.5B layer on an H100, 4 x 2048 tokens: forward +
backward 7.07 ms eager, 5.20 compiled; with peft LoRA adapters 8.18 and 5.64;
``bench/results/2026-12-07-h100-session54/call3/``). Inside MemFerry's planned steps on the
HF Qwen2-1.5B shape with LoRA under 8 GB: 1.826 s a step against 2.836 eager
(``bench/results/2026-12-08-h100-session57/``). Session 55's 1.1 % on the DESIGN §3 GPT and
session 56's LoRA row had run their blocks eagerly, the profiler having left dynamo skipping the
block class (:class:`CompiledForward`). Bench rows report ``compiled_runs_per_step``
(:func:`compiled_runs`).

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

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .config import UnitPlan

if TYPE_CHECKING:
    from .profiler import BlockProfile, StepProfile

__all__ = ["CompiledForward", "compile_forward", "compiled_runs", "compiles", "block_as_run", "compiled_note"]


class _CountedInductor:
    """A dynamo backend: Inductor, counting each run of the forward graphs it compiled.

    Dynamo runs a wrapped forward eagerly, and says nothing, where it skips the frame (a
    ``TorchDispatchMode`` on the stack that does not ``ignore_compile_internals``: the cpu
    backend's tracker did, session 56) or gives up on it (its recompile limit): the count shows
    whether blocks ran compiled. One instance for every block, so blocks of one class share their
    graphs (dynamo reuses a graph only for the backend that compiled it)."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._dynamo import lookup_backend

        compiled = lookup_backend("inductor")(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]  # how dynamo calls it
        return run


_COUNTED = _CountedInductor()


def _mode_stops_dynamo() -> bool:
    """Whether a ``TorchDispatchMode`` on the stack makes dynamo skip a frame: one that is neither
    torch's own (infra) nor says it ``ignore_compile_internals`` (torch 2.13's test)."""
    for mode in _get_current_dispatch_mode_stack():
        ignores = getattr(mode, "ignore_compile_internals", None)
        if not (mode.is_infra_mode() or (ignores is not None and ignores())):
            return True
    return False


class CompiledForward:
    """A block's forward through ``torch.compile``, run eagerly while a dispatch mode would stop dynamo.

    Why: dynamo skips a frame it meets under such a mode and marks its code object to be skipped
    from then on, in every instance of the class, silently (session 56: one call under
    ``selective_recompute``'s byte-counting mode in the profiler left every block of the step
    eager, and a plan priced compiled ran at eager speed). Calling the eager forward there keeps
    the compiled one usable.

    Attributes:
        eager: the forward it wraps.
        compiled: ``torch.compile``'s wrapper of it.
    """

    def __init__(self, eager: Callable[..., Any]) -> None:
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=False, backend=_COUNTED)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _mode_stops_dynamo():
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def compile_forward(module: nn.Module) -> None:
    """Make ``module.forward`` (its own attribute, else the class's, bound) a :class:`CompiledForward`
    of it: ``torch.compile``'s, for fixed shapes (``dynamic=False``: a new shape compiles once
    more), through Inductor (counted: :func:`compiled_runs`)."""
    module.forward = CompiledForward(module.forward)


def compiled_runs() -> int:
    """How many times, in this process, compiled code of a forward wrapped by :func:`compile_forward`
    ran (each block's forward, and its recomputation under checkpointing, counts once)."""
    return _COUNTED.runs


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
