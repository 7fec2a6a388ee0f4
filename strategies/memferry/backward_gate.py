"""The engine's backward bookkeeping, run from inside autograd, so a plain ``loss.backward()``
(what Hugging Face's Trainer and accelerate call) drives MemFerry as ``engine.backward(loss)`` does.

A grad-enabled forward registers a gradient hook on every tensor it returns that requires grad.
Every gradient of the model flows through those tensors, so autograd runs a hook before any of
the model's backward: it calls ``engine._backward_begins()`` (micro-batch count, learning rate,
the executor's backward modes; once per backward) and that queues ``engine._backward_ends()``
with the autograd engine's final callbacks (as DDP and FSDP do), run once the backward is done.
Hooks, not an identity ``autograd.Function``: the outputs stay the model's own tensors, which
callers (Trainer's loss scaling) may still modify in place; a custom Function's outputs are
views that may not be, or copies (the logits).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["gate_outputs", "queue_at_backward_end"]


def queue_at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward now running ends (torch has no public API for this; DDP and FSDP use the same)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _collect(x: Any, out: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)


def gate_outputs(outputs: Any, begin: Callable[[], None]) -> Any:
    """``outputs`` (a tensor, or tuples / lists / dicts of them), each tensor that requires grad
    given a hook calling ``begin`` when backward reaches it (``begin`` must act once per backward)."""
    found: list[torch.Tensor] = []
    _collect(outputs, found)
    for t in {id(t): t for t in found}.values():
        t.register_hook(lambda grad: begin())  # returns None: the gradient goes on unchanged
    return outputs
