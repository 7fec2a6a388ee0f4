"""How a block's saved activations grow with the sequence: measured at the sample's length and at
half of it, so a plan can be sized for rows of another length (``batch_growth.py``).

Most of what a block keeps for backward grows with its tokens (rows x sequence), but attention
that materialises its scores (eager attention; the cpu's math kernel) keeps rows x heads x
sequence² more. Scaled by tokens alone, a GPT block profiled at 64-token rows under-counted
256-token rows: the plan made for them predicted 43.6 MB and ran out of a 44.3 MB budget on the
cpu backend. So the profiler also measures what each distinct block saves with the sample's rows
cut to half their length (:func:`half_sequence_bytes`); with ``act(T) = lin * T + quad * T**2`` per
row the two readings give both parts, and :func:`grown_bytes` sizes the block at any rows and
sequence. The block inputs come from running the model on the host up to its first block
(:func:`capture_block_input`), as the profiler's full-length ones do.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from xpu import Backend

from .hf_models import model_loss

__all__ = ["batch_shape", "sample_shape", "padded", "capture_block_input", "block_on_device", "saved_bytes",
           "half_sequence_bytes", "grown_bytes", "longest"]

_log = logging.getLogger("xpu.memferry")

#: Rows shorter than this are not halved (too few tokens to tell the parts apart).
MIN_SEQ = 4


def batch_shape(inputs: tuple, kwargs: dict) -> tuple[int, int]:
    """``(rows, sequence)`` of a forward's inputs: from its token ids (``input_ids`` or the first
    tensor argument: ``(..., T)``) or embeddings (``inputs_embeds``: ``(..., T, hidden)``);
    ``(0, 0)`` where there is no tensor."""
    first = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not isinstance(first, torch.Tensor):
        first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 0, 0
    if first.is_floating_point() and first.dim() >= 3:
        seq = first.shape[-2]
        return first.numel() // (seq * first.shape[-1]), seq
    seq = first.shape[-1]
    return first.numel() // max(seq, 1), seq


def sample_shape(inputs: Any) -> tuple[int, int]:
    """:func:`batch_shape` of a sample's ``inputs``: token ids, or a mapping of keyword arguments."""
    return batch_shape((), dict(inputs)) if isinstance(inputs, Mapping) else batch_shape((inputs,), {})


def padded(inputs: Any) -> bool:
    """Whether a forward's keyword arguments (or a sample's mapping of them) carry a 2-D
    ``attention_mask`` with a zero in it: padding, which a masked forward pays for in memory."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 0).any())


def longest(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """The most rows and the longest sequence among ``(rows, sequence)`` shapes (a step's micro-batches)."""
    return max(r for r, _ in shapes), max(t for _, t in shapes)


class _Captured(Exception):
    """Raised by the pre-hook on block 0 to stop the host forward once its input is known."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


def capture_block_input(model: nn.Module, first_block: nn.Module, inputs: Any, targets: Any,
                        loss_fn: Callable | None) -> tuple[tuple, dict]:
    """Run the model on the host only up to block 0 and return block 0's arguments."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(args, kwargs)

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            if loss_fn is None and targets is not None:
                model_loss(model, inputs, targets)
            else:
                model(inputs)
    except _Captured as got:
        return got.args, got.kwargs
    finally:
        handle.remove()
    raise ValueError("the model's forward never called its first block; pass blocks= to name the repeated blocks")


def _halved(x: Any, seq: int) -> Any:
    """``x`` with its sequence dimension (the last of token ids, length ``seq``) cut to its first half."""
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == seq:
        return x[..., : seq // 2].contiguous()
    return x


def block_on_device(block: nn.Module, args: tuple, kwargs: dict, backend: Backend,
                    device: int) -> tuple[nn.Module, tuple, dict]:
    """A copy of ``block`` on the device (gradients must not land in the user's model) and its
    arguments there, the floating inputs requiring a gradient as in training."""
    blk = copy.deepcopy(block).to(backend.device(device))
    x_args, x_kwargs = torch.utils._pytree.tree_map(
        lambda t: backend.to_device(t.detach(), device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    for t in torch.utils._pytree.tree_leaves(x_args):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.requires_grad_(True)  # backward computes the input's gradient too
    return blk, x_args, x_kwargs


def saved_bytes(blk: nn.Module, forward: Callable[[], Any], small_below: int = 0) -> tuple[int, int, Any]:
    """``(bytes, small, output)`` of ``forward()``: the bytes autograd saves for backward, each
    storage once and ``blk``'s parameters left out; of those, the ones in tensors below
    ``small_below`` bytes (what activation offload leaves on the device)."""
    own = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    seen: dict[int, int] = {}
    small: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own and ptr != 0:
            seen[ptr] = storage.nbytes()
            if t.numel() * t.element_size() < small_below:
                small[ptr] = storage.nbytes()
        # not ``t``: an output saved by its own node would then hold that node (a cycle through
        # autograd's C++ that no collector sees) until the graph is run backward, if ever
        return t.detach()

    # Never traced: torch 2.11 on an H100 traced the hook when a compiled block saved through it,
    # guarded on each pointer and recompiled it to dynamo's limit (session 55, one profile).
    with torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack), lambda t: t):
        out = forward()
    return sum(seen.values()), sum(small.values()), out


def _saved_bytes(block: nn.Module, args: tuple, kwargs: dict, backend: Backend, device: int) -> tuple[int, Any]:
    """Bytes autograd saves in one forward of a copy of ``block`` on the device (as the profiler
    counts them), and its output on the host."""
    blk, x_args, x_kwargs = block_on_device(block, args, kwargs, backend, device)
    nbytes, _, out = saved_bytes(blk, lambda: blk(*x_args, **x_kwargs))
    first = next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return nbytes, first.detach().to("cpu")


def half_sequence_bytes(model: nn.Module, blocks: list[nn.Module], signature: Callable[[nn.Module], Any], inputs: Any,
                        targets: Any, loss_fn: Callable | None, backend: Backend, device: int) -> dict[Any, int]:
    """What each distinct block (by ``signature``) saves for backward with the sample's rows cut
    to half their length; empty where the rows are too short or the inputs have no sequence."""
    _, seq = sample_shape(inputs)
    if seq < MIN_SEQ or not isinstance(inputs, (torch.Tensor, Mapping)):
        return {}
    half = {k: _halved(v, seq) for k, v in inputs.items()} if isinstance(inputs, Mapping) else _halved(inputs, seq)
    try:
        return _half_bytes(model, blocks, signature, half, _halved(targets, seq), loss_fn, backend, device)
    except Exception as exc:  # noqa: BLE001 - a model that takes only its own length: scaled by tokens alone
        _log.info("MemFerry: no half-length profile (%s: %s); longer batches are scaled by tokens alone",
                  type(exc).__name__, exc)
        return {}


def _half_bytes(model: nn.Module, blocks: list[nn.Module], signature: Callable[[nn.Module], Any], inputs: Any,
                targets: Any, loss_fn: Callable | None, backend: Backend, device: int) -> dict[Any, int]:
    args, kwargs = capture_block_input(model, blocks[0], inputs, targets, loss_fn)
    found: dict[Any, int] = {}
    for block in blocks:
        sig = signature(block)
        if sig in found:
            continue
        found[sig], out = _saved_bytes(block, args, kwargs, backend, device)
        first = next(t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
        if out.shape == first.shape:
            args = (out,) + tuple(args[1:])
    return found


def grown_bytes(act: int, half: int, seq_from: int, tokens_ratio: float, seq_ratio: float) -> tuple[int, float]:
    """A block's saved bytes ``act`` (measured at ``seq_from``; ``half`` at half of it, 0: not
    measured) at ``tokens_ratio`` times the tokens and ``seq_ratio`` times the sequence, and the
    share of ``act`` that grows with the sequence's square (attention scores)."""
    if not half or seq_from < MIN_SEQ:
        return int(round(act * tokens_ratio)), 0.0
    quad = min(max(2 * (act - 2 * half), 0), act)  # act(T) - 2 act(T/2) = quad(T) / 2
    share = quad / act if act else 0.0
    return int(round((act - quad) * tokens_ratio + quad * tokens_ratio * seq_ratio)), share
