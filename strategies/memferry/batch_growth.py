"""A micro-batch longer than the one the plan was made for is planned for before it runs.

A plan is made from one profiled batch (``sample``), and what it keeps on the device grows with a
micro-batch's tokens (batch x sequence): activations, the loss's slices, the inputs. A run whose
batches vary (Hugging Face's collators pad each batch to its longest row) then meets longer
batches than the sample, and under a tight budget a plan that fit the sample runs out of memory.

So the engine counts each grad-enabled micro-batch's tokens (:func:`batch_tokens`). At a step's
first micro-batch with more tokens than it was fitted to, it predicts its plan's peak at those
tokens on the profile scaled to them (:func:`scaled_profile`: activation and loss bytes and
times in proportion; attention that is quadratic in the sequence would grow faster, which the
out-of-memory re-plan then catches). If that is over the budget, the engine is built again, its
weights and optimizer state kept, for the plan the scheduler makes from the scaled profile
(``oom_recovery.rebuild_keeping_state``), before the batch runs. A loop that has a step's
micro-batches first fits the engine to the longest (``MemFerry.fit_tokens``: ``xpu train``'s loop,
and the Trainer integration's ``get_batch_samples``). A longer micro-batch later in a
step cannot change the plan (the step's earlier gradients are summed in its buffers): the engine
warns, remembers the length, and plans for it at the next step's start; if that micro-batch runs
out of memory, ``replan_after_oom`` plans for it and the step runs again (``xpu train`` does so by
itself). Give ``sample`` a batch as long as the longest you will train on to plan once.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from xpu.units import format_bytes

if TYPE_CHECKING:
    from .engine import MemFerry
    from .profiler import StepProfile

__all__ = ["batch_tokens", "scaled_profile", "longest_tokens", "fit_batch"]

_log = logging.getLogger("xpu.memferry")

_BLOCK_SCALED = ("fwd_s", "bwd_s", "recompute_s", "bwd_selective_s", "fwd_selective_s", "act_bytes",
                 "act_bytes_recompute", "act_bytes_offload_kept", "act_bytes_selective")
_STEP_SCALED = ("rest_fwd_s", "rest_bwd_s", "loss_peak_bytes", "input_bytes")


def batch_tokens(inputs: tuple, kwargs: dict) -> int:
    """Tokens (rows of the blocks' matmuls) of a forward's inputs: the element count of its
    token ids (``input_ids`` or the first tensor argument), or of embeddings over their last
    dimension; 0 where there is no tensor."""
    first = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not isinstance(first, torch.Tensor):
        first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return 0
    if first.is_floating_point() and first.dim() >= 3:
        return first.numel() // first.shape[-1]
    return first.numel()


def scaled_profile(profile: "StepProfile", tokens: int) -> "StepProfile":
    """``profile`` as a micro-batch of ``tokens`` tokens would have measured it: what grows with
    tokens (activation and loss bytes, inputs, compute times) in proportion; weights, rates and
    settings as they were."""
    if tokens == profile.tokens or profile.tokens <= 0:
        return profile
    r = tokens / profile.tokens

    def scale(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
        values = {n: getattr(obj, n) * r for n in names}
        return {n: math.ceil(v) if isinstance(getattr(obj, n), int) else v for n, v in values.items()}

    blocks = [dataclasses.replace(b, **scale(b, _BLOCK_SCALED)) for b in profile.blocks]
    return dataclasses.replace(profile, blocks=blocks, tokens=int(tokens), **scale(profile, _STEP_SCALED),
                               notes=[*profile.notes, f"scaled from {profile.tokens} to {tokens} tokens"])


def longest_tokens(engine: "MemFerry") -> int:
    """The most tokens of a micro-batch ``engine``'s plan must hold: what it was made or fitted
    for, or a longer micro-batch met later in a step (planned for at the next one)."""
    setup, profile = engine._setup, engine.plan.profile
    return max(profile.tokens if profile is not None else 0, setup.get("tokens", 0), setup.get("tokens_next", 0))


def fit_batch(engine: "MemFerry", tokens: int) -> None:
    """Before a grad-enabled forward of ``tokens`` tokens: plan for them where they are more than
    the engine was fitted to and its plan's predicted peak at them is over the budget (see the
    module docstring)."""
    from .cost import links_from_probe, predict
    from .oom_recovery import budget_bytes, cap_at_budget, rebuild_keeping_state, rebuild_refusal
    from .planning import replan
    from .scheduler import NoPlanFitsError

    setup, plan = engine._setup, engine.plan
    if not engine.micro.backwards:  # a step's first micro-batch: plan for the longest the last step had too
        tokens = max(tokens, setup.pop("tokens_next", 0))
    if plan.profile is None or tokens <= setup.setdefault("tokens", plan.profile.tokens):
        return
    budget, margin = budget_bytes(engine), setup["memory_margin"]
    profile = scaled_profile(plan.profile, tokens)
    peak = predict(plan, profile, links_from_probe(engine.backend, engine.device), margin).peak_bytes
    if peak <= budget:
        setup["tokens"] = tokens
        cap_at_budget(engine)  # the cap held to the old prediction would not hold the longer batch
        return
    said = (f"a micro-batch of {tokens} tokens, {tokens / plan.profile.tokens:.2f}x the {plan.profile.tokens} the "
            f"plan was made for, would peak at {format_bytes(peak)} over the {format_bytes(budget)} budget")
    why = ("it comes after the step's first micro-batch, whose gradients the plan's buffers hold" if engine.micro.backwards
           else rebuild_refusal(engine))
    if why:
        if setup.get("warned_tokens", 0) < tokens:
            setup["warned_tokens"] = tokens
            _log.warning("MemFerry: %s; it runs on the plan as it is, which cannot be made again now (%s); give "
                         "sample= a batch as long as the longest you train on", said, why)
        if engine.micro.backwards:
            setup["tokens_next"] = max(setup.get("tokens_next", 0), tokens)  # planned for at the next step
        else:
            setup["tokens"] = tokens  # run as it is: not predicted again (an out-of-memory re-plan plans for it)
        return
    try:
        again = replan(plan, budget, engine.backend, engine.device, margin, profile=profile)
    except NoPlanFitsError as exc:
        raise NoPlanFitsError(f"{said}, and no plan fits it: {exc}", exc.minimum) from None
    rebuild_keeping_state(engine, again)
    setup["tokens"] = tokens
    note = f"{said}: planned again for {tokens} tokens, predicted peak {format_bytes(again.predicted_peak_bytes or 0)}"
    engine.plan.notes.append(note)
    _log.warning("MemFerry: %s", note)
