"""The cross-entropy over token slices, each slice's gradients made in forward.

:class:`~strategies.models.base.CausalLM` computes its loss over ``loss_chunks`` token slices
so that no whole fp32 logits exist. Recomputing each slice in backward (torch's checkpoint,
the way it began) runs the output head twice per slice: on the DESIGN §3 GPT (vocab 32000,
8 × 1024 tokens) that is 1.07 TFLOP, about 1.8 ms of an H200, per micro-batch. Here forward
runs each slice's backward at once, on the slice's own small graph, and keeps only what the
outer backward returns: the gradient of the final hidden states (tokens × hidden) and of the
head's parameters (one of each, as backward would hold them). The head runs once per slice.

Exactness. The slices' gradients are made, and summed, as recomputation makes them: the same
function (``slice_loss``), autograd's own backward of it, the last slice's weight gradient
first (the order autograd's engine adds them in). They are made for the gradient scale
``loss.backward()`` gives (``1 / count`` per slice), and backward multiplies them by the ratio of
the scale it receives to that one, on the device (no synchronisation): bit-equal to recomputing
when that ratio is a power of two (``(loss / N).backward()`` for N = 1, 2, 4, 8, ...), else
within one rounding of the logits' gradient. Not differentiable twice, and one backward per
forward (``retain_graph`` twice is refused with a message).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["sliced_loss_sum", "summed_slices"]

SliceLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def summed_slices(slice_loss: SliceLoss, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """The sum over ``chunks`` token slices of ``slice_loss(h_slice, targets_slice)``, in slice
    order from an fp32 zero, as autograd sees it (``slice_loss`` may wrap itself in a checkpoint)."""
    total = h.new_zeros((), dtype=torch.float32)
    for hs, ts in zip(h.chunk(chunks), targets.chunk(chunks)):
        total = total + slice_loss(hs, ts)
    return total


def sliced_loss_sum(slice_loss: SliceLoss, head: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                    chunks: int, count: torch.Tensor) -> torch.Tensor:
    """The sum over ``chunks`` token slices of ``slice_loss(h_slice, targets_slice)`` (each a
    summed fp32 cross-entropy through ``head``), its gradients made in forward.

    Args:
        slice_loss: one slice's summed loss, ``(hidden slice, target slice) -> fp32 scalar``.
        head: the module ``slice_loss`` runs; its parameters that need a gradient get one.
        h: final hidden states, ``(tokens, hidden)``.
        targets: ``(tokens,)`` class indices (-100: ignored).
        chunks: how many slices (``torch.chunk``'s rule).
        count: the mean's denominator the caller divides the sum by (a 0-dim integer tensor):
            the gradient scale of ``loss.backward()`` is ``1 / count``.
    """
    params = [p for p in head.parameters() if p.requires_grad]
    return _SlicedLoss.apply(slice_loss, h, targets, chunks, count, *params)


class _SlicedLoss(torch.autograd.Function):
    """Forward: the slices' summed losses and, at once, their gradients; backward: those, scaled."""

    @staticmethod
    def forward(ctx, slice_loss: SliceLoss, h: torch.Tensor, targets: torch.Tensor, chunks: int,  # type: ignore[override]
                count: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # What DivBackward hands each slice when loss.backward() starts at the mean (1 / count).
        scale = torch.ones((), dtype=torch.float32, device=h.device) / count
        want_h = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        h_slices, t_slices = h.chunk(chunks), targets.chunk(chunks)
        g_slices = grad_h.chunk(chunks) if grad_h is not None else [None] * len(h_slices)
        sums: list[torch.Tensor | None] = [None] * len(params)
        parts: list[torch.Tensor] = [h.new_zeros((), dtype=torch.float32)] * len(h_slices)
        with torch.enable_grad():
            # Last slice first: autograd's engine runs the later-made slice's backward first and
            # adds the head's gradients in that order.
            for i in reversed(range(len(h_slices))):
                hs = h_slices[i].detach().requires_grad_(want_h)
                part = slice_loss(hs, t_slices[i])
                inputs = ([hs] if want_h else []) + list(params)
                grads = list(torch.autograd.grad(part, inputs, scale, allow_unused=True)) if inputs else []
                if want_h:
                    g_slices[i].copy_(grads.pop(0))
                for j, g in enumerate(grads):
                    if g is not None:
                        sums[j] = g if sums[j] is None else sums[j].add_(g)
                parts[i] = part.detach()
        total = h.new_zeros((), dtype=torch.float32)
        for part in parts:  # in slice order, as summed_slices adds them
            total = total + part
        ctx.scale, ctx.grads = scale, (grad_h, *sums)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError("the sliced loss's gradients were made in forward and are given out once: to run "
                               "backward twice through one forward (retain_graph), recompute the slices instead "
                               "(a CausalLM: model.loss_grad_in_forward = False)")
        grads, ctx.grads = ctx.grads, None
        ratio = grad_total / ctx.scale  # 1 for loss.backward(); 1/N for (loss / N).backward()
        out = [g.mul_(ratio) if g is not None else None for g in grads]
        return (None, out[0], None, None, None, *out[1:])
