"""The device-memory terms of MemFerry's cost model that do not depend on a plan's timing.

Bytes per parameter of a device-homed unit, what ``rest`` (embeddings, head, final norm) holds
all step, the transient on top of it (the loss, a block's backward beside ``rest``'s gradients,
a device-homed ``rest``'s update), the fp32 sum of a block summing its micro-batches on the
device (:func:`device_sum_bytes`), the loss's shape-based estimate and the automatic choice of
``loss_chunks``. :mod:`strategies.memferry.cost` combines them into a plan's peak.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["device_bytes_per_param", "held_grad_bytes", "grads_persist", "device_sum_bytes", "loss_peak_estimate",
           "LOSS_SLICE_SHARE", "auto_loss_chunks", "rest_resident_bytes", "transient_parts", "transient_bytes", "peak_bytes"]


def device_bytes_per_param(dtype_bytes: int, grad_bytes: int = 0) -> int:
    """Device bytes per parameter of a device-homed unit, as ``ShadowModel`` allocates them:
    compute-dtype weights, fp32 master (the same buffer in fp32) and two fp32 moments (14 B in
    bf16, 12 B in fp32), plus ``grad_bytes`` of gradient held all step (:func:`held_grad_bytes`)."""
    return dtype_bytes + (0 if dtype_bytes == 4 else 4) + 8 + grad_bytes


def held_grad_bytes(profile: "StepProfile") -> int:
    """Bytes per device-homed parameter of gradient the ``DeviceOptimizer`` holds across the step:

    * 4 under gradient accumulation (``accumulation_steps > 1``): it sums micro-batches into the
      fp32 buffer and frees it after the update (Qwen2-1.5B's device-homed tied head: 934 MB,
      resident through every later micro-batch; counted as a transient, an 8 GB plan ran out
      of memory); likewise with clipping under data parallelism (the fp32 sum is averaged);
    * the compute dtype's with clipping alone: it holds the gradients autograd made until
      ``step()`` knows the coefficient, and upcasts them one unit at a time to update (not
      resident all step: the cost model places them, ``cost.State.excess``);
    * 0 otherwise: the fp32 buffer lives only while the unit's update runs.

    The first is counted from the step's start (:func:`grads_persist`)."""
    if grads_persist(profile):
        return 4
    return profile.dtype_bytes if getattr(profile, "clipping", False) else 0


def grads_persist(profile: "StepProfile") -> bool:
    """Whether device-homed units' fp32 gradient buffers stay allocated all step (so their
    update needs no fp32 transient): see :func:`held_grad_bytes`."""
    if getattr(profile, "accumulation_steps", 1) > 1:
        return True
    return getattr(profile, "clipping", False) and getattr(profile, "data_parallel", False)


def device_sum_bytes(numel: int) -> int:
    """Device bytes of a host-updated block planned ``accumulate="device"``: its fp32 sum of the
    micro-batches' gradients, allocated at the step's first micro-batch and freed once copied
    home in its last, so held through every later forward and backward (counted all step, as
    :func:`grads_persist` counts a device-homed unit's buffer)."""
    return 4 * numel


def loss_peak_estimate(tokens: int, vocab: int, hidden: int, chunks: int = 1, dtype_bytes: int = 4) -> int:
    """Device bytes the head and loss add at their peak, from their shapes: an upper estimate
    of what the profiler measures (on the tiny test models it is 5-50 % above the measured).

    The account, for ``chunks`` token slices (``loss_chunks``; each slice's logits made again
    in backward, or its gradients made in forward): one slice's logits in fp32, their
    log-softmax and their gradient (3 x 4 B per logit), plus the compute-dtype logits and their
    gradient where that is not fp32; the head weight's gradient, one slice's contribution to it
    before accumulation, and (tied to the input embedding) the lookup's dense gradient (3 x
    vocab x hidden in the compute dtype); the final hidden states and their gradient (2 x
    tokens x hidden). The head's weights themselves are the ``rest`` unit's, always resident on the
    device (counted apart, with ``rest_param_bytes``).
    """
    chunks = max(1, min(int(chunks), int(tokens)))
    per = math.ceil(tokens / chunks) * vocab
    logits = per * (12 + (2 * dtype_bytes if dtype_bytes != 4 else 0))
    return int(logits + 3 * vocab * hidden * dtype_bytes + 2 * tokens * hidden * dtype_bytes)


#: Share of the device budget one slice's fp32 logits may take when ``loss_chunks`` is chosen
#: for the user (:func:`auto_loss_chunks`): with log-softmax and gradient the loss then takes
#: about 3/32 of the budget.
LOSS_SLICE_SHARE = 1 / 32


def auto_loss_chunks(tokens: int, vocab: int, budget_bytes: int | float, share: float = LOSS_SLICE_SHARE) -> int:
    """The fewest token slices whose fp32 logits each stay within ``share`` of ``budget_bytes``
    (1 when the whole logits already do; at most one slice per token).

    Qwen2-1.5B at 4 x 2048 tokens (vocab 151936) under 8 GB: whole logits 4.98 GB, 20 slices.
    """
    whole = tokens * vocab * 4
    return int(max(1, min(tokens, math.ceil(whole / max(1.0, budget_bytes * share)))))


def rest_resident_bytes(profile: "StepProfile", rest_optimizer: str) -> int:
    """Device bytes ``rest`` (embeddings, head, final norm) holds all step: its compute-dtype
    weights, plus the fp32 master and moments when it is device-homed, and then the fp32
    gradient buffer it holds across the step (:func:`grads_persist`; otherwise that buffer is a
    transient, and the gradients autograd makes, held to ``step()`` under clipping alone, are
    ``rest``'s gradients of :func:`transient_bytes`)."""
    held = held_grad_bytes(profile) if grads_persist(profile) else 0
    per = device_bytes_per_param(profile.dtype_bytes, held) if rest_optimizer == "device" else profile.dtype_bytes
    # All its weights (frozen ones, as a LoRA run's embeddings, too); the rest per trainable parameter.
    return profile.rest_param_bytes + profile.rest_numel * (per - profile.dtype_bytes)


def transient_parts(profile: "StepProfile", rest_optimizer: str) -> tuple[int, int, int]:
    """The plan-independent terms of :func:`transient_bytes`: the loss peak, ``rest``'s gradients
    (held through backward) and what the step's end holds of ``rest`` (its gradients, and its
    update's fp32 buffer when device-homed and not already resident)."""
    rest_grads = profile.rest_numel * profile.dtype_bytes
    end = rest_grads + (profile.rest_numel * 4 if rest_optimizer == "device" and not grads_persist(profile) else 0)
    return profile.loss_peak_bytes, rest_grads, end


def peak_bytes(profile: "StepProfile", rest_optimizer: str, depth: int, mem: Any, excess: Any, slot: Any,
               end_held: Any, nslot: Any) -> Any:
    """A plan's peak before the fragmentation margin, from its blocks' sums (``cost.State``'s
    ``mem``, ``excess``, ``slot``, ``r`` as ``end_held``, ``nslot``): ``rest`` resident, the inputs,
    the blocks' bytes, ``nslot`` prefetch slots of ``slot`` bytes and :func:`transient_bytes`.
    Scalars (``cost.finish``) or arrays of partial plans (the scheduler's searches) alike, so the
    searches' pruning and the final prediction are one expression, equal to the byte (whole
    bytes are exact in float64 below 2**53)."""
    fewer = np.where(nslot > depth, slot, 0)  # at the loss, one slot fewer where all depth + 1 are counted
    return (rest_resident_bytes(profile, rest_optimizer) + profile.input_bytes + mem + nslot * slot
            + transient_bytes(profile, rest_optimizer, excess, end_held, fewer))


def transient_bytes(profile: "StepProfile", rest_optimizer: str, excess: Any, end_held: Any = 0, slot: Any = 0) -> Any:
    """What the step adds at its worst point to the resident bytes, every block's saved
    activations and the prefetch slots, given ``excess`` (the worst block backward: its
    transient, with the gradients the blocks above it hold less the activations they freed:
    ``cost.State.excess``), ``end_held`` (the same balance of every block at the step's end:
    ``cost.State.r``) and ``slot`` (scalars or arrays):

    * the loss (``loss_peak_bytes``: one slice's fp32 logits, their log-softmax and gradient,
      the head's weight gradient, the hidden-state gradient; measured with ``loss_chunks``),
      before any block's backward: ``slot`` fewer is held then (forward's last ``depth`` loads
      kept for backward, none issued for it yet: :func:`peak_bytes` passes the largest
      prefetched block where ``depth + 1`` slots are counted, 0 where fewer blocks are prefetched);
    * a block's backward, beside ``rest``'s gradients: they stay on the device until its last
      one lands (the input embedding's, at backward's end; a tied head's is that same one);
    * the step's end: ``rest``'s gradients and, when device-homed, its update's fp32 buffer
      (already resident under gradient accumulation: :func:`rest_resident_bytes`).
    """
    loss, rest_grads, end = transient_parts(profile, rest_optimizer)
    return np.maximum(np.maximum(loss - slot, excess + rest_grads), end_held + end)
