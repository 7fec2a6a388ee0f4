"""MemFerry's scheduler: per-block modes that minimise the predicted step under a device budget.

    profile = profile_step(model, units, backend, device, x, y, loss_fn=...)
    links = links_from_probe(backend, device)
    plan = schedule(profile, links, budget_bytes, len(profile.blocks))
    print(plan.describe())

Why this dynamic program, and why it is exact for the cost model (``cost.py``):
the predicted step is not a sum over blocks. It is ``max(compute chain, host-optimizer
chain terms)``, where the host chain runs over blocks in backward order and each host-homed
unit's finish is compared with the point of the *next* forward that needs it. ``cost.py``
writes that as a recurrence over blocks from the last to the first (:func:`~.cost.advance`)
on a small state: forward time so far, backward time so far, the host worker's finish, the
worst resolved host term, the finishes still waiting for their release point (one per
prefetch slot), the memory sum, the worst backward point, the largest slot, and what the blocks
hold at the step's end beyond that sum (held gradients less freed activations). Every transition's result is non-decreasing
in every state component, and so is the final prediction (:func:`~.cost.finish`) and peak
memory. Hence if two partial plans of blocks ``s..N-1`` end in the same choice for block
``s`` (the next transition also reads block ``s``'s copy time), the one whose state is
component-wise no larger can be completed at least as well as the other in time *and*
memory: dropping dominated states (Pareto pruning) loses no optimum. The DP keeps, per
block and per choice of that block, the Pareto set of states; partial plans whose memory
already exceeds the budget with the cheapest completion are dropped. The outer loop
enumerates ``rest_optimizer`` and ``prefetch_depth``. Memory is kept exactly, not in
buckets, so the budget check is the cost model's own.

Per block the choices are every :class:`UnitPlan` the executor accepts: resident (host- or
device-homed) or prefetch / DHA per pass, each keeping, recomputing or offloading its
activations, or recomputing them selectively (without DHA; a different backward mode needs
recompute); DHA only where ``allow_dha`` (and the links have a DHA
rate). Under gradient accumulation (``profile.accumulation_steps > 1``) every host-updated
choice without DHA comes twice more: summing its micro-batches on the host or on the device
(``UnitPlan.accumulate``: device memory for fewer link and host-memory bytes).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Sequence

from xpu.errors import XpuError
from xpu.units import format_bytes

from .batched_predict import one_block_changes
from .block_costs import sums_on_host_by_choice  # re-exported: where the scheduler's choices are filtered
from .clip_plan import for_clip
from .config import Plan, UnitPlan
from .cost import (SCALARS, Links, Prediction, State, advance_rows, describe_units, finish, initial_state, option_cost,
                   predict)
from .host_budget import host_budget, rest_terms
from .host_room import with_host_room
from .least_memory import block_options, least_memory, loss_slicing_hint, peak_rows
from .named_plans import named_predictions
from .pareto import pareto_front

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["NoPlanFitsError", "unit_choices", "sums_on_host_by_choice", "schedule", "brute_force_budgets", "min_budget", "price",
           "planned_host_rate", "host_numel"]

_GB = 1e9


class NoPlanFitsError(XpuError, ValueError):
    """No MemFerry plan fits the device budget; ``minimum`` is the least budget (bytes) that
    would fit. A ``ValueError`` as before, and an :class:`~xpu.errors.XpuError` so the ``xpu``
    command prints its one line and exits 2."""

    def __init__(self, message: str, minimum: int | None = None) -> None:  # default: unpickles from args
        super().__init__(message)
        self.minimum = minimum
#: Block count up to which every block gets its own choice by default; longer models are
#: decided in groups of consecutive blocks, about this many groups (see ``schedule``).
GROUP_ABOVE = 24
#: Label cap up to ``GROUP_ABOVE`` blocks. On the docs/design.md §3 profile (24 blocks, host-memory
#: model, margin 5 %; 2-core machine) 1000 labels found plans predicted as fast as 4000 did (under
#: 17.7 GB 163.7 ms against 164 ms; under 8 GB 292.1 ms both; with 8 micro-batches 1364.5 against
#: 1364 ms and 1590.1 ms both) in 8-31 s against 24-272 s: the Pareto pruning's work grows about
#: as the square of the labels kept.
LABELS = 1000
#: Label cap past ``GROUP_ABOVE`` blocks. On the docs/design.md §3 profile (24 blocks) 300 labels
#: predicted within 0.6 % of 4000 in a third of the time; 96 blocks in groups of 4 took 23 s.
LONG_MODEL_LABELS = 300


def unit_choices(allow_dha: bool = True, allow_device_optimizer: bool = True,
                 device_sum: bool = False) -> list[UnitPlan]:
    """Every per-block plan the executor runs (``check_plan``'s rules); ``device_sum``: with the
    ``accumulate="device"`` variants of host-updated ones without DHA (gradient accumulation)."""
    modes = ["prefetch", "dha"] if allow_dha else ["prefetch"]
    # activations: kept, recomputed, offloaded to host, or recomputed selectively (not with DHA)
    acts = ((False, False, False), (True, False, False), (False, True, False), (True, False, True))
    out = [UnitPlan("resident", "resident", r, "host", o, selective=s) for r, o, s in acts]
    if allow_device_optimizer:
        out += [UnitPlan("resident", "resident", r, "device", o, selective=s) for r, o, s in acts]
    for f, b in itertools.product(modes, modes):
        for r, o, s in acts:
            if (f != b and not r) or (s and "dha" in (f, b)):
                continue  # without recompute backward reads what forward saved: same mode
            out.append(UnitPlan(f, b, r, offload=o, selective=s))
    if device_sum:
        out += [replace(u, accumulate="device") for u in out if u.optimizer == "host" and "dha" not in (u.forward, u.backward)]
    return out


def prune_choices(choices: Sequence[UnitPlan], profile: "StepProfile", links: Links) -> list[UnitPlan]:
    """``choices`` without those that can never win on this profile, since each multiplies the
    DP's labels: activation offload when, for every block, moving the activations out and back
    takes longer than recomputing them (it would only ever buy the block input's bytes over
    recompute, at a loss of time); selective recompute where the profile has no figures for it
    (written before it was measured) or where, for every block, it is no faster than recomputing
    everything (it keeps more bytes, so full recompute is better on both counts: on the H200 the
    eager dispatch mode's per-op cost made a Qwen2 layer's selective backward 8.3 ms against
    6.9 ms for forward and backward again)."""
    rate = min(links.h2d_GBps, links.d2h_GBps) * 1e9
    offload = any(b.act_bytes / rate < b.fwd_s for b in profile.eager_blocks or profile.blocks)  # offloading runs eagerly
    selective = all(b.act_bytes_selective for b in profile.blocks) and any(
        (b.fwd_selective_s or b.fwd_s) + b.bwd_selective_s < b.fwd_s + b.recompute_time + b.bwd_s
        for b in profile.blocks)
    return [c for c in choices if (offload or not c.offload) and (selective or not c.selective)]


def _run_dp(profile: "StepProfile", links: Links, budget: float, choices: Sequence[UnitPlan], rest_optimizer: str,
            depth: int, margin: float, upper: float, cap: int | None,
            group: int = 1) -> tuple[Prediction, list[int], bool] | None:
    """Best plan for one (rest_optimizer, depth) with predicted step below ``upper``, or None.

    ``group``: blocks ``g*group .. (g+1)*group - 1`` take one choice (1: every block its own).

    Returns (prediction, choice per block in forward order, whether the label cap cut).
    """
    n = len(profile.blocks)
    opts = block_options(profile, links, choices, depth)
    usable = [[c for c, o in enumerate(row) if math.isfinite(o.a) and math.isfinite(o.b)] for row in opts]
    # Cheapest completions of blocks 0..s-1, for pruning: memory (all step; at the step's end),
    # forward and backward time.
    min_mem, min_fwd, min_bwd, min_hm = [0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
    min_end = [0] * (n + 1)
    for s in range(n):
        min_mem[s + 1] = min_mem[s] + min(opts[s][c].persist + opts[s][c].act for c in usable[s])
        min_end[s + 1] = min_end[s] + min(opts[s][c].grads - opts[s][c].act for c in usable[s])
        min_fwd[s + 1] = min_fwd[s] + min(opts[s][c].a + opts[s][c].r for c in usable[s])
        min_bwd[s + 1] = min_bwd[s] + min(opts[s][c].b for c in usable[s])
        min_hm[s + 1] = min_hm[s] + min(opts[s][c].hm for c in usable[s])
    rest_host = rest_optimizer == "host"
    by_deadline = profile.host_order == "deadline"
    t_rest = profile.rest_fwd_s + profile.rest_bwd_s
    pre_min = profile.rest_param_bytes / (links.h2d_GBps * 1e9) if rest_host else 0.0
    u_rest = 0.0 if rest_host else profile.rest_numel * profile.device_adamw_s_per_param
    h_rest, _, hm_rest, _ = rest_terms(profile, host_budget(profile, links), rest_host)

    def lower_bound(st: np.ndarray, s: int) -> np.ndarray:
        """Step times no completion of these partial plans (state rows; blocks s..N-1 chosen) can beat."""
        phi, psi, late, m = st[:, 0], st[:, 1], st[:, 2], st[:, 3]
        phi_all = phi + min_fwd[s]
        lb = pre_min + phi_all + t_rest + psi + min_bwd[s] + u_rest
        # Pending units are released further down, after at least the forward so far.
        late = np.maximum(late, phi + st[:, SCALARS:SCALARS + depth].max(axis=1))
        if rest_host and by_deadline:  # rest's update delays every unit's
            late = late + h_rest
        elif rest_host:  # rest's waits for every unit's
            late = np.maximum(late, pre_min + phi_all + m + h_rest)
        lb = np.maximum(lb, t_rest + late)
        return np.maximum(lb, st[:, SCALARS + depth + 3] + min_hm[s] + hm_rest)

    k = SCALARS + depth  # the State.key columns of mem, excess, slot, hm, psi0, r, pend, nslot
    # Partial plans by the choice of their top block: state rows, and each row's parent (the
    # choice and row of the block above it); one such layer per block, kept for the way back.
    layers: list[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
    layer = {-1: (np.array([initial_state(depth).key()]), np.array([-1]), np.array([-1]))}
    capped = False
    for s in range(n - 1, -1, -1):
        grown: dict[int, list[tuple[np.ndarray, int, np.ndarray]]] = {}
        free = (s + 1) % group == 0 or s == n - 1  # the top block of its group chooses
        for prev_choice, (rows, _, _) in layer.items():
            nxt_opt = opts[s + 1][prev_choice] if prev_choice >= 0 else None
            if free or prev_choice < 0:
                candidates = usable[s]
            else:  # inside a group: the choice of the block above, where this block can take it
                candidates = [prev_choice] if prev_choice in usable[s] else []
            for c in candidates:
                st = advance_rows(rows, opts[s][c], nxt_opt)
                # Memory only grows: drop what cannot fit even with the cheapest completion,
                # and what cannot beat a plan already in hand.
                ok = peak_rows(profile, rest_optimizer, depth, st[:, k] + min_mem[s], st[:, k + 1], st[:, k + 2],
                               margin, st[:, k + 5] + min_end[s], st[:, k + 7]) <= budget
                ok &= lower_bound(st, s) < upper
                if ok.any():
                    idx = np.flatnonzero(ok)
                    grown.setdefault(c, []).append((st[idx], prev_choice, idx))
        layer = {}
        for c, parts in grown.items():
            rows = np.concatenate([p[0] for p in parts])
            keep, cut = pareto_front(rows, cap)
            parent = np.concatenate([np.full(len(p[2]), p[1]) for p in parts])
            layer[c] = (rows[keep], parent[keep], np.concatenate([p[2] for p in parts])[keep])
            capped |= cut
        layers.append(layer)
        if not layer:
            return None
    best: tuple[Prediction, int, int] | None = None
    for c, (rows, _, _) in layer.items():
        for j, row in enumerate(rows):
            pred = finish(State.from_key(row, depth), opts[0][c], profile, links, rest_optimizer, depth, margin)
            if pred.peak_bytes > budget or pred.step_s >= upper:
                continue
            if best is None or pred.step_s < best[0].step_s:
                best = (pred, c, j)
    if best is None:
        return None
    picks, (_, c, j) = [], best
    for layer in reversed(layers):  # block 0 first: the DP went from the last block down
        picks.append(c)
        _, parent, index = layer[c]
        c, j = int(parent[j]), int(index[j])
    return best[0], picks, capped


def _incumbent(named: Sequence[tuple[Plan, Prediction]], budget: float) -> tuple[float, Plan] | None:
    """The best of the plans ``Plan.from_spec`` names, with their predictions (a starting bound
    for the DP)."""
    fits = [(p.step_s, plan) for plan, p in named if p.peak_bytes <= budget]
    return min(fits, key=lambda f: f[0]) if fits else None


def min_budget(profile: "StepProfile", links: Links, choices: Sequence[UnitPlan] | None = None,
               rest_optimizers: Iterable[str] = ("host", "device"), depths: Iterable[int] = (1, 2),
               margin: float = 0.10) -> int:
    """The smallest device budget (bytes) under which some plan over ``choices`` (None: every
    one) fits, by the cost model: exact (:func:`~.least_memory.least_memory`)."""
    return least_memory(profile, links, list(choices or unit_choices()), rest_optimizers, depths, margin)[0]


def schedule(profile: "StepProfile", links: Links, budget_bytes: int | float, n_blocks: int | None = None,
             allow_dha: bool = True, allow_device_optimizer: bool = True, depths: Iterable[int] = (1, 2),
             rest_optimizers: Iterable[str] = ("host", "device"), margin: float = 0.10,
             explain: bool = True, max_labels: int | None | str = "auto", group_blocks: int | None = None,
             host_sums: bool = True, device_sums: bool = True, prune: bool = True, host_room: bool = True) -> Plan:
    """The plan with the smallest predicted step time whose predicted peak fits ``budget_bytes``
    (or, where that one is host-tight, one predicted within 1 % of it that leaves the host room:
    ``host_room.py``).

    Args:
        profile: measured figures (:func:`~.profiler.profile_step`).
        links: link rates (:func:`~.cost.links_from_probe`).
        budget_bytes: device memory the plan may use (margin for fragmentation included in
            the prediction it is compared with).
        n_blocks: the model's block count, checked against the profile (None: the profile's).
        allow_dha: consider DHA modes (needs ``links.dha_read_GBps``; the caller passes
            ``backend.caps.dha``).
        allow_device_optimizer: consider device-homed blocks and ``rest``.
        depths: prefetch depths to consider.
        rest_optimizers: where ``rest`` may be updated.
        margin: allocator-fragmentation margin on predicted peak memory.
        explain: fill ``Plan.notes`` with a line per block (costs a few predictions per block).
        max_labels: most non-dominated partial plans kept per block and choice (None: no
            limit, always exact; ``"auto"``: :data:`LABELS` up to :data:`GROUP_ABOVE` blocks, else
            :data:`LONG_MODEL_LABELS`); when it cuts, a note says the plan is not proven optimal.
        group_blocks: consecutive blocks that take one choice. None: 1 up to
            :data:`GROUP_ABOVE` blocks, else enough to leave about that many decisions (the
            search's work grows faster than the block count: 24 blocks take up to 20 s on a
            2-core machine, 128 free blocks would take hours); a note says so.
        host_sums: with gradient accumulation, let a host-updated block sum its micro-batches
            on the host; False: every block that can (not DHA) sums them on the device
            (``sum_placement.py`` races such a plan against a host-summing one).
        device_sums: False: no block sums its micro-batches on the device (the other side of
            that race).
        prune: leave out the choices that never win on time (:func:`prune_choices`); where
            then no plan fits, the search runs again with them (offload keeps a block's input
            off the device, which recompute does not).
        host_room: where the fastest plan's host work nearly fills its compute chain, take a
            plan predicted as fast with more host room (:func:`~.host_room.with_host_room`);
            False: the fastest, always.

    Returns:
        A :class:`Plan` with ``predicted_step_s`` and ``notes`` filled.

    Raises:
        ValueError: ``n_blocks`` differs from the profile.
        NoPlanFitsError: no plan fits the budget (the message states the smallest budget that
            would; a ``ValueError`` too).
    """
    n = len(profile.blocks)
    if n_blocks is not None and n_blocks != n:
        raise ValueError(f"the profile has {n} blocks, the model {n_blocks}")
    allow_dha = allow_dha and bool(links.dha_read_GBps)
    rest_optimizers = [r for r in rest_optimizers if allow_device_optimizer or r == "host"]
    every = unit_choices(allow_dha, allow_device_optimizer, profile.accumulation_steps > 1)
    if not host_sums and profile.accumulation_steps > 1:
        every = [u for u in every if not sums_on_host_by_choice(u)]
    if not device_sums:
        every = [u for u in every if u.accumulate != "device"]
    choices = prune_choices(every, profile, links) if prune else every
    depths = list(depths)
    rest_optimizers = list(rest_optimizers)
    group = group_blocks if group_blocks is not None else max(1, math.ceil(n / GROUP_ABOVE))
    if max_labels == "auto":
        max_labels = LABELS if n <= GROUP_ABOVE else LONG_MODEL_LABELS
    if group < 1:
        raise ValueError(f"group_blocks must be a positive number of blocks, got {group_blocks}")
    named = named_predictions(profile, links, margin, choices, rest_optimizers, depths)
    inc = _incumbent(named, float(budget_bytes))
    upper = inc[0] * (1 + 1e-9) if inc else math.inf  # a DP plan must beat the incumbent to replace it
    best: tuple[Prediction, Plan] | None = None
    capped = False
    for depth in depths:
        for rest_optimizer in rest_optimizers:
            got = _run_dp(profile, links, float(budget_bytes), choices, rest_optimizer, depth, margin, upper, max_labels,
                          group)
            if got is None:
                continue
            pred, picks, cut = got
            capped |= cut
            if best is None or pred.step_s < best[0].step_s:
                best = (pred, Plan([choices[c] for c in picks], depth, rest_optimizer))
                upper = min(upper, pred.step_s)
    if best is None and inc is not None:
        best = (predict(inc[1], profile, links, margin), inc[1])
    least_note = None
    if best is None:
        need, least = least_memory(profile, links, every, rest_optimizers, depths, margin)
        if need > budget_bytes:
            raise NoPlanFitsError(f"no plan fits a device budget of {format_bytes(budget_bytes)}: the smallest plan "
                                  f"needs {format_bytes(need)} ({need} bytes, {margin:.0%} fragmentation margin "
                                  f"included); raise device_budget to at least that"
                                  + loss_slicing_hint(profile, links, every, rest_optimizers, depths, margin,
                                                      budget_bytes), minimum=need)
        if len(choices) < len(every):  # only what was left out for time fits
            return schedule(profile, links, budget_bytes, n_blocks, allow_dha=allow_dha,
                            allow_device_optimizer=allow_device_optimizer, depths=depths,
                            rest_optimizers=rest_optimizers, margin=margin, explain=explain, max_labels=max_labels,
                            group_blocks=group_blocks, host_sums=host_sums, device_sums=device_sums, prune=False)
        # Blocks decided in groups, or partial plans cut at the label cap, left the search none
        # that fits; one that keeps the least memory does (least_memory.py), if not the fastest.
        best = (predict(least, profile, links, margin), least)
        least_note = (f"note: the search found no plan under this budget within its limits (groups of {group} "
                      f"blocks, {max_labels} partial plans per block and choice); this is the plan of least device "
                      f"memory ({format_bytes(need)}), not the fastest that fits: a larger budget, group_blocks=1 or "
                      f"max_labels=None may find a faster one")
    room_note = None
    if host_room and least_note is None:
        def search(slower: "StepProfile") -> Plan:
            return schedule(slower, links, budget_bytes, n_blocks, allow_dha=allow_dha,
                            allow_device_optimizer=allow_device_optimizer, depths=depths, rest_optimizers=rest_optimizers,
                            margin=margin, explain=False, max_labels=max_labels, group_blocks=group_blocks,
                            host_sums=host_sums, device_sums=device_sums, prune=prune, host_room=False)

        plan, pred, room_note = with_host_room(best[1], predict(best[1], profile, links, margin), profile, links,
                                               float(budget_bytes), margin, search)
        best = (pred, plan)
    plan, clip_note = best[1], None
    rate = getattr(profile, "clip_fire_rate", 0.0)
    if rate and getattr(profile, "clipping", False):  # weigh the steps after clipped ones too (clip_plan.py)
        plan, clip_note = for_clip(plan, profile, links, float(budget_bytes), margin, rate, named)
    pred = price(plan, profile, links, margin)  # the same numbers, with the host-work total filled in
    plan.notes = _explain(plan, pred, profile, links, float(budget_bytes), choices, margin) if explain else []
    plan.notes += [n for n in (room_note, clip_note, least_note) if n]
    if group > 1:
        plan.notes.append(f"note: blocks were decided in groups of {group} consecutive blocks ({n} blocks); "
                          f"group_blocks=1 searches every block's choice (slower)")
    if capped:
        plan.notes.append(f"note: the search kept at most {max_labels} partial plans per block and choice; this plan "
                          f"is the best found, not proven optimal (raise max_labels)")
    return plan


def price(plan: Plan, profile: "StepProfile", links: Links, margin: float) -> Prediction:
    """Fill in ``plan``'s predicted step, peak and host rate from ``profile`` (which it keeps, to
    be made again from it); returns the prediction."""
    pred = predict(plan, profile, links, margin)
    plan.predicted_step_s = pred.step_s
    plan.predicted_peak_bytes = int(pred.peak_bytes)
    plan.host_s_per_param, plan.host_earlier_s_per_param = planned_host_rate(plan, profile, links, pred)
    plan.profile = profile
    return pred


def planned_host_rate(plan: Plan, profile: "StepProfile", links: Links, pred: Prediction) -> tuple[float, float]:
    """Host seconds per host-updated parameter the prediction assumes (what
    ``HostOptimizer.measured_s_per_param`` measures in steps: accumulation and backups
    included), and the part of it summing the earlier micro-batches; the profile's rate (and 0)
    where no host budget applies or nothing is host-updated."""
    numel = host_numel(plan, profile)
    if host_budget(profile, links) is None or not numel:
        return profile.host_adamw_s_per_param * profile.host_update_scale, 0.0
    return pred.host_optimizer_s / numel, pred.parts.get("host_earlier_s", 0.0) / numel


def host_numel(plan: Plan, profile: "StepProfile") -> int:
    """Parameters ``plan`` updates on the host (its host-updated blocks, and ``rest`` where it is)."""
    numel = sum(b.numel for b, u in zip(profile.blocks, plan.units) if u.optimizer == "host")
    return numel + (profile.rest_numel if plan.rest_optimizer == "host" else 0)


def _host_line(pred: Prediction, profile: "StepProfile", links: Links) -> str:
    """The host-memory budget's figures, for the plan's first note line."""
    hb = host_budget(profile, links)
    if hb is None:
        return f"; host AdamW {profile.host_adamw_s_per_param * 1e9:.3f} ns/param as profiled (no host-memory model)"
    spill = pred.parts.get("earlier_spill_s", 0.0)
    return (f"; host memory {hb.bandwidth_GBps:.1f} GB/s, AdamW bytes weigh {hb.kernel_weight:.2f}, a link byte "
            f"{hb.copy_weight:.2f} ({hb.source}): {pred.parts.get('host memory', 0.0) * 1e3:.1f} ms of it per step"
            + (f"; the sums starting in the last earlier micro-batch overrun it by {spill * 1e3:.1f} ms, which the "
               "updates wait for" if spill > 0 else ""))


def _explain(plan: Plan, pred: Prediction, profile: "StepProfile", links: Links, budget: float,
             choices: Sequence[UnitPlan], margin: float) -> list[str]:
    """Per block: what it chose, its predicted times, and the best alternative for that block."""
    ms = 1e3
    lines = [f"predicted: step {pred.step_s * ms:.1f} ms, bound by the {pred.bound}; compute chain "
             f"{pred.compute_s * ms:.1f} ms, host AdamW work {pred.host_optimizer_s * ms:.1f} ms; peak "
             f"{pred.peak_bytes / _GB:.2f} GB of {budget / _GB:.2f} GB (margin {margin:.0%}); links h2d "
             f"{links.h2d_GBps:.1f} GB/s, d2h {links.d2h_GBps:.1f} GB/s ({links.source}); prefetch depth "
             f"{plan.prefetch_depth}, rest optimizer on the {plan.rest_optimizer}; loss peak "
             f"{profile.loss_peak_bytes / _GB:.3f} GB at loss_chunks {profile.loss_chunks}" + _host_line(pred, profile, links)]
    changed = one_block_changes(plan, profile, links, margin, choices)
    for i, u in enumerate(plan.units):
        o = option_cost(profile, links, i, u, plan.prefetch_depth)
        alt_line = ""
        best_alt: tuple[float, UnitPlan] | None = None
        for c in choices:
            if c == u:
                continue
            p = changed[(i, c)]
            if p.peak_bytes <= budget and (best_alt is None or p.step_s < best_alt[0]):
                best_alt = (p.step_s, c)
        if best_alt is not None:
            alt_line = (f"; best alternative {describe_units([best_alt[1]])} predicts "
                        f"{best_alt[0] * ms:.1f} ms ({(best_alt[0] - pred.step_s) * ms:+.1f} ms)")
        else:
            alt_line = "; every alternative for this block breaks the budget"
        lines.append(f"block {i:3d}: {describe_units([u])}: fwd {o.a * ms:.2f} ms (copy {o.x * ms:.2f}), bwd "
                     f"{o.b * ms:.2f} ms (copy {o.y * ms:.2f}), host AdamW {o.h * ms:.2f} ms, device "
                     f"{(o.persist + o.act + o.grads) / _GB:.3f} GB{alt_line}")
    return lines


def brute_force_budgets(profile: "StepProfile", links: Links, budgets: Sequence[float], allow_dha: bool = True,
                        allow_device_optimizer: bool = True, depths: Iterable[int] = (1, 2),
                        rest_optimizers: Iterable[str] = ("host", "device"),
                        margin: float = 0.10) -> list[tuple[float, Plan] | None]:
    """The best plan (its predicted step and the plan; None where none fits) under each of ``budgets``,
    by trying every one, each predicted once (tests only: exponential in the block count)."""
    n = len(profile.blocks)
    allow_dha = allow_dha and bool(links.dha_read_GBps)
    choices = prune_choices(unit_choices(allow_dha, allow_device_optimizer, profile.accumulation_steps > 1), profile,
                            links)
    best: list[tuple[float, Plan] | None] = [None] * len(budgets)
    for depth in depths:
        opts = block_options(profile, links, choices, depth)  # predict()'s terms, computed once per block and choice
        # predict_options' recurrence for every combination at once, a level at a time (advance_rows
        # is bit-equal to advance), each group of rows by the choice of the block below them
        rows, combos = np.array([initial_state(depth).key()]), np.zeros((1, 0), dtype=int)
        for s in range(n - 1, -1, -1):
            below = ([(None, np.arange(len(rows)))] if s + 1 == n else
                     [(opts[s + 1][j], np.flatnonzero(combos[:, 0] == j)) for j in range(len(choices))])
            grown, chosen = [], []
            for c in range(len(choices)):
                for nxt, idx in below:
                    grown.append(advance_rows(rows[idx], opts[s][c], nxt))
                    chosen.append(np.column_stack([np.full(len(idx), c), combos[idx]]))
            rows, combos = np.concatenate(grown), np.concatenate(chosen)
        for rest_optimizer in rest_optimizers:
            if rest_optimizer == "device" and not allow_device_optimizer:
                continue
            for row, combo in zip(rows, combos):
                p = finish(State.from_key(row, depth), opts[0][combo[0]], profile, links, rest_optimizer, depth, margin)
                for k, budget in enumerate(budgets):
                    if p.peak_bytes <= budget and (best[k] is None or p.step_s < best[k][0]):
                        best[k] = (p.step_s, Plan([choices[c] for c in combo], depth, rest_optimizer))
    return best
