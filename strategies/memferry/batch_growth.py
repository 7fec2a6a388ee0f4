"""A micro-batch longer than the one the plan was made for is planned for before it runs.

A plan is made from one profiled batch (``sample``), and what it keeps on the device grows with a
micro-batch's tokens (batch x sequence): activations, the loss's slices, the inputs. A run whose
batches vary (Hugging Face's collators pad each batch to its longest row) then meets longer
batches than the sample, and under a tight budget a plan that fit the sample runs out of memory.

So the engine reads each grad-enabled micro-batch's rows and sequence length
(``sequence_scaling.batch_shape``). At a step's first micro-batch longer or wider than it was
fitted to, it predicts its plan's peak there on the profile scaled to it (:func:`scaled_profile`:
activation and loss bytes and times in proportion to the tokens, and the part of the
activations that grows with the sequence's square, measured at profiling, by that too). If that
is over the budget, the engine is built again, its weights and optimizer state kept, for the
plan the scheduler makes from the scaled profile (``oom_recovery.rebuild_keeping_state``),
before the batch runs. A loop that has a step's micro-batches first fits the engine to the
longest (``MemFerry.fit_shape``: ``xpu train``'s loop, and the Trainer integration's
``get_batch_samples``). A longer micro-batch later in a step cannot change the plan (the step's earlier gradients are summed in its buffers): the engine
warns, remembers the length, and plans for it at the next step's start; if that micro-batch runs
out of memory, ``replan_after_oom`` plans for it and the step runs again (``xpu train`` does so by
itself). Give ``sample`` a batch as long as the longest you will train on to plan once.

The memory model is a model: at the sample's shape the rehearsal checks it, and at a new shape
the first step does the same (:func:`settle_watch`): it runs with the cap lifted and its peak
measured, and where it went over the budget the plan is made again with a margin covering the
miss before the next step, which is measured in turn, up to ``rehearsal.ATTEMPTS`` times (a
GPT's attention backward on the cpu kept 14.9 MB where 13.4 were predicted at 4 x 128 tokens;
the plan made again then peaked at 9.3 MB of a 13.5 MB budget:
bench/results/2026-12-04-cpu-session28/watch-gpt.txt). A padded micro-batch on a plan profiled
without padding is watched the same way, once (:func:`watch_unplanned_padding`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from xpu.units import format_bytes

from .sequence_scaling import grown_bytes, padded

if TYPE_CHECKING:
    from .engine import MemFerry
    from .profiler import StepProfile

__all__ = ["scaled_profile", "longest_shape", "fit_batch", "settle_watch", "watch_unplanned_padding"]

_log = logging.getLogger("xpu.memferry")

_BLOCK_SCALED = ("fwd_s", "bwd_s", "recompute_s", "bwd_selective_s", "fwd_selective_s", "act_bytes",
                 "act_bytes_recompute", "act_bytes_offload_kept", "act_bytes_selective")
_STEP_SCALED = ("rest_fwd_s", "rest_bwd_s", "loss_peak_bytes", "input_bytes")


def scaled_profile(profile: "StepProfile", rows: int, seq: int) -> "StepProfile":
    """``profile`` as a micro-batch of ``rows`` x ``seq`` tokens would have measured it: what grows
    with tokens (activation and loss bytes, inputs, compute times) in proportion, and the part of
    the activations that grows with the sequence's square (``sequence_scaling.grown_bytes``) by
    that too; weights, rates and settings as they were. A profile of unknown sequence
    (``profile.seq`` 0) scales by tokens alone."""
    tokens = rows * seq
    if tokens == profile.tokens and (not profile.seq or seq == profile.seq) or profile.tokens <= 0:
        return profile
    r = tokens / profile.tokens
    s = seq / profile.seq if profile.seq else 1.0

    def scale(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
        values = {n: getattr(obj, n) * r for n in names}
        return {n: math.ceil(v) if isinstance(getattr(obj, n), int) else v for n, v in values.items()}

    def block(b: Any) -> Any:
        act, share = grown_bytes(b.act_bytes, b.act_bytes_half_seq, profile.seq, r, s)
        quad = share * b.act_bytes * r * s  # the part growing with the square, at the new shape
        half = int(round((act - quad) / 2 + quad / 4)) if b.act_bytes_half_seq else 0
        grown = {**scale(b, _BLOCK_SCALED), "act_bytes": act, "act_bytes_half_seq": half,
                 # backward's intermediates grow as the activations do
                 **{n: math.ceil(getattr(b, n) * act / b.act_bytes) if b.act_bytes else 0
                    for n in ("bwd_extra_bytes", "bwd_recompute_bytes", "bwd_selective_bytes")}}
        if share:  # selective recompute keeps the attention scores' matmul output too
            grown["act_bytes_selective"] = int(round(b.act_bytes_selective * r * (1 + share * (s - 1))))
        return dataclasses.replace(b, **grown)

    return dataclasses.replace(profile, blocks=[block(b) for b in profile.blocks],
                               eager_blocks=[block(b) for b in profile.eager_blocks], tokens=int(tokens),
                               seq=seq if profile.seq else 0, **scale(profile, _STEP_SCALED),
                               notes=[*profile.notes, f"scaled from {profile.tokens} to {tokens} tokens ({rows} x {seq})"])


def longest_shape(engine: "MemFerry") -> tuple[int, int]:
    """The longest micro-batch, ``(rows, sequence)``, ``engine``'s plan must hold: what it was made
    or fitted for, and one met later in a step (planned for at the next one), dimension by dimension."""
    setup, profile = engine._setup, engine.plan.profile
    base = _profile_shape(profile) if profile is not None else (0, 0)
    fitted, later = setup.get("shape", (0, 0)), setup.get("shape_next", (0, 0))
    return max(base[0], fitted[0], later[0]), max(base[1], fitted[1], later[1])


def plan_holds_longest(engine: "MemFerry") -> bool:
    """Whether ``engine``'s plan was made for the longest micro-batch it must hold
    (:func:`longest_shape`); a plan given rather than scheduled counts as made for it."""
    profile = engine.plan.profile
    if profile is None:
        return True
    rows, seq = longest_shape(engine)
    made = _profile_shape(profile)
    return rows <= made[0] and seq <= made[1]


def _profile_shape(profile: "StepProfile") -> tuple[int, int]:
    """``(rows, sequence)`` a profile was measured at (one row of ``tokens`` where its sequence is not known)."""
    return (profile.tokens // profile.seq, profile.seq) if profile.seq else (1, profile.tokens)


def watch_unplanned_padding(engine: "MemFerry", kwargs: dict) -> None:
    """A padded micro-batch (``attention_mask`` with zeros) on a plan profiled on a sample without
    padding: a masked forward allocates more than was measured (up to 4.7 % of the peak on a tiny
    Llama, bench/results/2026-12-05-cpu-session31/padded-sample.txt). Once per engine its step (the
    next one where it comes after a step's first micro-batch) is measured as a new shape's first
    step is (:func:`settle_watch`): planned again, with a margin covering what it used past the
    budget, where it went over. Said once, with how to give the sample."""
    from .oom_recovery import budget_bytes, rebuild_refusal

    profile, setup = engine.plan.profile, engine._setup
    if profile is None or profile.padded or not padded(kwargs):
        return
    if not setup.get("padding_seen"):
        setup["padding_seen"], setup["padding_watch"] = True, True
        _log.warning("MemFerry: this micro-batch is padded (its attention_mask has zeros) but the plan was profiled on "
                     "a sample without padding, and a masked forward takes more memory than was measured: a padded "
                     "step's peak is measured, and the plan made again if it goes over the budget. Give the sample "
                     "as the model is called to plan for it at once: sample=({'input_ids': ids, 'attention_mask': "
                     "mask}, labels)")
    if not setup.get("padding_watch") or engine.micro.backwards:
        return  # mid-step: the next step's first padded micro-batch starts the watch
    del setup["padding_watch"]
    if "watch" not in setup and rebuild_refusal(engine) is None:
        _watch(engine, budget_bytes(engine))


def fit_batch(engine: "MemFerry", rows: int, seq: int) -> None:
    """Before a grad-enabled forward of ``rows`` x ``seq`` tokens: plan for them where they are
    more than the engine was fitted to and its plan's predicted peak there is over the budget
    (see the module docstring)."""
    setup, plan = engine._setup, engine.plan
    if plan.profile is None or not rows:
        return
    if not plan.profile.seq:  # sequence not known: tokens alone, as one long row
        rows, seq = 1, rows * seq
    first = not engine.micro.backwards
    fitted = setup.setdefault("shape", _profile_shape(plan.profile))
    later = setup.pop("shape_next", (0, 0)) if first else (0, 0)  # a step's first: the last step's longest too
    want = (max(rows, fitted[0], later[0]), max(seq, fitted[1], later[1]))
    if want == fitted:  # every forward comes here: nothing more before this
        return
    from .cost import links_from_probe, predict
    from .oom_recovery import budget_bytes, rebuild_keeping_state, rebuild_refusal
    from .planning import replan
    from .scheduler import NoPlanFitsError

    budget, margin = budget_bytes(engine), setup["memory_margin"]
    profile = scaled_profile(plan.profile, *want)
    peak = predict(plan, profile, links_from_probe(engine.backend, engine.device), margin).peak_bytes
    if peak <= budget:
        setup["shape"] = want
        _watch(engine, budget)
        return
    said = (f"micro-batches of {want[0]} x {want[1]} tokens, beyond the {fitted[0]} x {fitted[1]} the plan holds, "
            f"would peak at {format_bytes(peak)} over the {format_bytes(budget)} budget")
    why = ("it comes after the step's first micro-batch, whose gradients the plan's buffers hold" if not first
           else rebuild_refusal(engine))
    if why:
        if setup.get("warned", (0, 0)) != want:
            setup["warned"] = want
            _log.warning("MemFerry: %s; it runs on the plan as it is, which cannot be made again now (%s); give "
                         "sample= a batch as long as the longest you train on", said, why)
        # planned for at the next step; or (no re-plan possible) run as it is, not predicted again
        setup["shape_next" if not first else "shape"] = want
        return
    try:
        again = replan(plan, budget, engine.backend, engine.device, margin, profile=profile)
    except NoPlanFitsError as exc:
        raise NoPlanFitsError(f"{said}, and no plan fits them: {exc}", exc.minimum) from None
    rebuild_keeping_state(engine, again)
    setup["shape"] = want
    note = f"{said}: planned again for them, predicted peak {format_bytes(again.predicted_peak_bytes or 0)}"
    engine.plan.notes.append(note)
    _log.warning("MemFerry: %s", note)
    _watch(engine, budget)


def _watch(engine: "MemFerry", budget: int, attempts: int | None = None) -> None:
    """Run the next step, the first at a new shape, as the rehearsal runs its step: the cap lifted
    and the peak measured from a released cache (:func:`settle_watch` reads it at ``step()``);
    ``attempts``: how many more plans a miss may make (default ``rehearsal.ATTEMPTS``)."""
    from .rehearsal import ATTEMPTS, start_peak

    engine.backend.set_memory_cap(engine.device, None)
    start_peak(engine.backend, engine.device)
    engine._setup["watch"] = (budget, ATTEMPTS if attempts is None else attempts)


def settle_watch(engine: "MemFerry") -> None:
    """At the end of a step run under :func:`_watch`: cap the device at the budget again and, where
    the step peaked over it (the memory model missed at the new shape), plan again with a margin
    covering what it missed, as the rehearsal does, and watch the next step too (the new plan's
    miss may differ), up to the attempts left. Nothing otherwise."""
    from .oom_recovery import cap_at_budget, rebuild_keeping_state, rebuild_refusal
    from .planning import replan
    from .rehearsal import covering_margin, measured_peak
    from .scheduler import NoPlanFitsError

    setup, backend, device = engine._setup, engine.backend, engine.device
    watched = setup.pop("watch", None)
    if watched is None:
        return
    budget, attempts = watched
    backend.synchronize(device)
    peak = measured_peak(backend, device)
    cap_at_budget(engine)
    predicted, margin = engine.plan.predicted_peak_bytes, setup["memory_margin"]
    if peak <= budget or not predicted or rebuild_refusal(engine):
        return
    shape = f"{setup['shape'][0]} x {setup['shape'][1]} tokens"
    if attempts < 1:
        _log.warning("MemFerry: a step at %s still peaked at %s, over the %s budget, after its re-plans; it runs "
                     "capped at the budget (give a larger device_budget or memory_margin)", shape, format_bytes(peak),
                     format_bytes(budget))
        return
    margin = covering_margin(peak, predicted, margin)
    try:
        again = replan(engine.plan, budget, backend, device, margin)
    except NoPlanFitsError as exc:  # the step is done: the next at this shape would not fit
        raise NoPlanFitsError(f"a step at {shape} peaked at {format_bytes(peak)}, over the {format_bytes(budget)} "
                              f"budget, and no plan fits it with the {margin:.0%} margin that covers that: {exc}",
                              exc.minimum) from None
    rebuild_keeping_state(engine, again)
    setup["memory_margin"] = margin
    note = (f"a step at {shape} peaked at {format_bytes(peak)}, over the {format_bytes(budget)} budget (predicted "
            f"{format_bytes(predicted)}): planned again with a {margin:.0%} memory margin, predicted peak "
            f"{format_bytes(again.predicted_peak_bytes or 0)}")
    engine.plan.notes.append(note)
    _log.warning("MemFerry: %s", note)
    _watch(engine, budget, attempts - 1)
