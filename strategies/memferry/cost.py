"""MemFerry's cost model: predicted step time and peak device memory of a plan.

Inputs are a :class:`~strategies.memferry.profiler.StepProfile` (per-block compute times and
activation bytes, parameter counts, AdamW rates, measured on the real backend) and
:class:`Links` (measured link rates from ``xpu probe``). Nothing here runs on a device.

The step, as the executor runs it (``executor.py``), in steady state:

* **forward**, blocks ``0..N-1`` on the compute stream. A prefetched block's copy is issued
  when the block ``prefetch_depth`` (non-DHA) places earlier starts, after the compute stream
  reaches that point (the slot frees), so it overlaps the previous block's compute: block
  ``i`` occupies the compute stream for ``phi_i = max(a_i + r_i, x_{i+1})`` (``a`` compute,
  ``r`` the un-overlapped reload of a stale host-homed *resident* block, ``x`` the next
  block's copy). A block planned DHA in forward runs its large linears as ``host_linear``
  (``dha_linear.py``) in both passes: at M = tokens per step above ``DHA_MAX_ROWS`` the
  weight streams through the copy engine once per pass, ``max(compute, 1.15 x bytes / h2d)``
  forward and ``max(c, l) + 0.5 min(c, l)`` backward with ``l = 1.15 x bytes / link`` (the
  weight in and its gradient home through the ring overlap on the full-duplex link, fitted on
  the H200: ``RING_SERIAL``); at small M it is
  read in place, ``max(compute, bytes / dha rate)``. Plain kernels over a DHA view (a block
  DHA only in backward, with recompute) cost ``max(compute, bytes / dha rate) * penalty(M)``
  times ``DHA_VIEW_CONTENTION``, the penalty from the probe's ``dha_matmul`` rows (cuBLAS
  re-reads host weights per output tile: docs/design.md §3), the factor for the host optimizer
  reading the same memory in such steps (``block_costs.py``). The first block's copy is not overlapped.
* **rest** (embeddings, head, loss) forward + backward between the passes: ``t_rest``.
* **backward**, blocks ``N-1..0``: ``psi_i = max(b_i, y_{i-1})`` with ``b`` recompute (in the
  backward mode; the forward as autograd issues it, ``BlockProfile.recompute_time``) + backward
  + the device AdamW of a device-homed unit, ``y`` the copy of the
  next block. The last block keeps its forward copy when it is prefetched in both passes.
* **gradients** of a host-homed unit land ``d = grad bytes / d2h`` after its backward; one
  host worker runs AdamW in landing order (blocks from last to first, ``rest`` last), or with
  ``AdamW.host_order="deadline"`` on the landed unit the next forward needs first
  (``host_tasks.py``: ``rest``, then blocks by index; an update under way yields to a sooner
  one between pieces), each unit ``h`` = its host-memory bytes (28 per parameter in one pass,
  plus accumulation and clipping's) at the bandwidth its own backward's copies leave
  (``host_budget.py``). Under
  gradient accumulation a block planned ``accumulate="device"`` adds each micro-batch into an
  fp32 device sum instead (``DEVICE_ADD_SHARE`` of its device AdamW time, in ``b``) and sends
  only the sum home, 4 bytes per parameter, on the last: ``d`` doubles in bf16, and the host
  neither receives nor adds the earlier micro-batches.
* **next forward**: a host-homed unit's update must be done before the executor touches it:
  at its own pre-forward for DHA / resident units, when its prefetch is *issued* (the
  executor's ``opt.wait`` in ``_issue_load``, ``prefetch_depth`` blocks earlier, or at
  ``begin_forward`` for the first ones) for prefetched units, and at ``begin_forward`` for
  a host-homed ``rest`` (which is then reloaded before anything else runs).

With ``C`` the compute-stream time of one step, ``l_k`` the landing time of unit ``k``'s
gradient (from backward's start), ``R_k`` the forward that follows its release point (a unit
released at the forward's block ``p`` delays only what follows ``p``) and ``H_k`` the host's
finish time of unit ``k``, the steady-state period is the max-plus fixed point

    step = max(C, t_rest + max_k (H_k + R_k) + G, M + G)

with ``G`` (``StepProfile.host_gap_s``) what a rehearsal measured a step bound by either host
term to run beyond its host work, over what these terms price (``host_calibration.with_gap``; 0
uncalibrated): the host worker's own time between its timed pieces and its waits for the GIL
are not modelled.
In landing order ``H_k = max(H_prev, l_k) + h_k`` (the dynamic program carries the chain's end
``m`` from the last block down). In deadline order (preemptive earliest-deadline-first) the
largest ``H_j + R_j`` is ``max_j (l_j + R_j + P_j)`` with ``P_j`` the host work of every unit due
no later than ``j``, which are those landing after it (``j``, the blocks below it, and
``rest``): carried as ``late = max(late, l_j + R_j) + h_j``. (Exact where units are due in index
order; where a host-homed resident or DHA block sits within ``prefetch_depth`` blocks below a
prefetched one it is an upper bound.) ``M``
(``host memory``) is every host-memory byte of the step (the optimizer's, and each host-link
byte weighted by what it costs host memory) over the host's bandwidth: the host worker and
every PCIe transfer share one DRAM (``host_budget.py``). Under gradient accumulation the
``n - 1`` micro-batches before the last add their forward and backward to ``C`` and to the
host terms (no updates, no reloads of ``rest``). Their host sums count in ``M``, and are taken
as done by the time the updates want the host, but for those that start in the last earlier
micro-batch (an odd count's last pair: ``OptionCost.h_tail``): what they take beyond that
micro-batch's compute delays the host chain (``earlier_spill_s``; a backlog carried from sums
further back is not counted). This closed
form is what :func:`predict` evaluates, with the exact recurrence the scheduler's dynamic
program uses (:func:`advance`, :func:`finish`), so the scheduler is optimal for this model.

Peak memory (bytes): resident ``rest`` (compute-dtype weights; + fp32 master and 2 moments
when device-homed) + per block (device-homed: the same 18 B/param in bf16; host-homed
resident: its weights) + prefetch slots (``depth + 1``, or as many as blocks are prefetched if
fewer, times the largest prefetched block) + the
largest of three points of the step (:func:`transient_bytes`):

* the loss, at the end of forward, with one prefetch slot fewer (forward's last loads are kept
  for backward, whose own are not issued yet): every block's saved activations (only the block
  input with recompute; with selective recompute also the matmuls' and attention's outputs, and
  forward and backward take their profiled ``fwd_selective_s`` and ``bwd_selective_s``) and the
  loss peak (logits in fp32 and their gradient: what OOMed the capped device12 run);
* each block's backward: the saved activations of it and the blocks below it (those above have
  freed theirs), the gradients the blocks above it hold to the step's end (device-homed units
  under clipping alone), its backward transient (what its backward makes, as profiled, at least
  its weights' gradients: ``bwd_extra_bytes``; recomputed, ``bwd_recompute_bytes`` or
  ``bwd_selective_bytes``, with the rebuilt activations; offloaded, its activations fetched back too)
  and ``rest``'s gradients (held until backward's end): ``State.excess``, the worst block;
* the step's end: the held gradients, ``rest``'s, and a device-homed ``rest``'s update;

all times ``1 + margin`` for allocator fragmentation (``memory_margin``: the only reserve; none is
added on top; it also covers CUDA's rounding and its cap on reserved bytes, docs/design.md §3.5). With gradient accumulation a
device-homed unit's fp32 gradient buffer is resident all step, not its update's transient
(:func:`grads_persist`), and so is the fp32 sum of a host-updated block planned
``accumulate="device"`` (:func:`~.memory_terms.device_sum_bytes`). The loss peak is measured by the profiler on the model as it will
run, ``loss_chunks`` included, for our ``CausalLM`` (gpt, llama), ``HFCausalLM`` and Hugging
Face models computing their own loss alike; where it cannot be measured it is
:func:`loss_peak_estimate` of the head's shape. The head's weights are ``rest``'s, resident.

Activation offload (``UnitPlan.offload``): the block's saved activations leave on the d2h
stream during its forward (``a = max(a, act / d2h)``) and return on the h2d stream behind the
weights during backward (``y += act / h2d``); they hold no device memory in between. An
offloaded block's backward fetches its own and, ahead, the next offloaded block's below it (the
swapper's look-ahead), which then stay through the backward of every block down to that one
(``State.pend``). Saved tensors below ``OFFLOAD_MIN_BYTES`` stay (``act_bytes_offload_kept``).

Not modelled: link contention between prefetch copies, DHA reads and gradient copies (the
probe measures 72-101 GB/s duplex against 55 GB/s per direction), but for a streamed
``host_linear`` block, priced no faster than the probe's copies beside host-memory load; D2H
queueing; a deeper prefetch's smoothing of uneven blocks (depth only costs slots here); how often the clip fires
(speculative by default, ``AdamW.clip_mode``: updates overlap backward as without it, but a
step whose clip fires re-applies them after backward, and the step after it waits for them:
:func:`predict_clip_fired` predicts that step; ``"wait"`` makes every step such a step; the
clip's bytes are counted); data parallelism's sharded host updates.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .block_costs import DEVICE_ADD_SHARE, RING_SERIAL, STREAM_OVERHEAD, OptionCost, option_cost  # noqa: F401
from .config import Plan, UnitPlan
from .host_budget import host_budget, rest_terms
from .links import H200_DHA_ROWS, Links, links_from_probe  # noqa: F401  (re-exported: the cost model's inputs)
from .memory_terms import (LOSS_SLICE_SHARE, auto_loss_chunks, device_bytes_per_param, device_sum_bytes,  # noqa: F401
                           grads_persist, held_grad_bytes, loss_peak_estimate, peak_bytes, rest_resident_bytes,
                           transient_bytes)

if TYPE_CHECKING:  # the profiler imports torch; the model itself needs only numbers
    from .profiler import StepProfile

__all__ = ["Links", "links_from_probe", "OptionCost", "option_cost", "Prediction", "predict", "predict_options",
           "predict_clip_fired", "State", "SCALARS",
           "initial_state", "advance", "advance_rows", "memory_rows", "slot_count", "finish", "device_bytes_per_param", "H200_DHA_ROWS", "loss_peak_estimate",
           "auto_loss_chunks", "rest_resident_bytes", "transient_bytes", "grads_persist"]

_NEG = -math.inf


@dataclass(frozen=True)
class State:
    """What the blocks processed so far (from the last block down) contribute.

    Each field of :func:`advance`'s result is non-decreasing in each field of its input, and the
    prediction is non-decreasing in each, which is what makes Pareto pruning in the scheduler
    exact. All but ``r`` also never decrease as blocks are added.

    Attributes:
        phi: forward compute-stream time of the processed blocks (from the current block on).
        psi: backward time before the current block's backward starts (first-block stall
            included), counted from the start of backward.
        late: the largest ``H_j + R_j`` so far (module docstring) over processed host units whose
            release point has been processed, the host term being ``t_rest + late`` once every
            block is in; in deadline order ``H_j`` counts only the processed units' work.
        m: landing order: the host's finish time of the last processed host unit, from
            backward start (-inf in deadline order).
        pending: ``H_j`` of prefetched units whose release point is still ahead (``pending[j]``:
            released at the (j+1)-th non-DHA block further down).
        mem: persistent + activation bytes; slot: largest prefetched block.
        excess: the worst point of backward so far: the largest, over processed blocks ``s``,
            of ``s``'s backward transient plus ``r`` of the blocks above ``s`` (by then they have
            freed their activations and hold their gradients); with ``mem`` of every block, the
            device's use at that point.
        hm: host-memory seconds of the processed blocks; psi0: ``phi`` and ``psi`` of an
            earlier micro-batch under gradient accumulation (no reloads of resident blocks, no
            device AdamW; 0 without).
        r: what the processed blocks hold at the step's end beyond ``mem``: the gradients
            device-homed units keep to ``step()`` (clipping alone, ``OptionCost.grads``) less
            the activations their backward freed (``act``); never above 0 without held gradients.
        pend: the worst backward point (as ``excess``) from the lowest offloaded block processed
            down: those points also hold the next offloaded block's activations, which the
            swapper's look-ahead brings back early (``OptionCost.fetch``), added to ``excess``
            when that block is processed; -inf while no block is offloaded.
        nslot: prefetch slots the processed blocks can hold at once: how many of them are
            prefetched, at most ``depth + 1`` (the one in use and the ``depth`` loads ahead of it).
        tail: host seconds of the processed blocks' sums that start in a step's last earlier
            micro-batch (``OptionCost.h_tail``): what of them overruns that micro-batch delays
            the updates (:func:`finish`).
    """

    phi: float
    psi: float
    late: float
    m: float
    pending: tuple[float, ...]
    mem: int
    excess: int
    slot: int
    hm: float = 0.0
    psi0: float = 0.0
    r: int = 0
    pend: float = _NEG
    nslot: int = 0
    tail: float = 0.0

    def key(self) -> tuple[float, ...]:
        """The components, for dominance checks."""
        return (self.phi, self.psi, self.late, self.m, *self.pending, float(self.mem), float(self.excess),
                float(self.slot), self.hm, self.psi0, float(self.r), self.pend, float(self.nslot), self.tail)

    @classmethod
    def from_key(cls, key: Sequence[float], prefetch_depth: int) -> "State":
        """The state whose :meth:`key` is ``key`` (a row of :func:`advance_rows`)."""
        k = SCALARS + prefetch_depth
        return cls(float(key[0]), float(key[1]), float(key[2]), float(key[3]), tuple(float(x) for x in key[SCALARS:k]),
                   int(key[k]), int(key[k + 1]), int(key[k + 2]), float(key[k + 3]), float(key[k + 4]), int(key[k + 5]),
                   float(key[k + 6]), int(key[k + 7]), float(key[k + 8]))


#: Columns of :meth:`State.key` before ``pending`` (phi, psi, late, m); mem, excess, slot, hm,
#: psi0, r, pend, nslot and tail follow it.
SCALARS = 4


def initial_state(prefetch_depth: int) -> State:
    """Nothing processed yet."""
    return State(0.0, 0.0, _NEG, _NEG, (_NEG,) * prefetch_depth, 0, 0, 0, 0.0, 0.0, 0, _NEG, 0, 0.0)


def advance(state: State, cur: OptionCost, nxt: OptionCost | None) -> State:
    """Add block ``s`` (``cur``) below the processed blocks ``s+1..N-1`` (``nxt`` is block s+1's
    terms, None when ``s`` is the last block)."""
    return State.from_key(advance_rows(np.array([state.key()]), cur, nxt)[0], len(state.pending))


def advance_rows(rows: np.ndarray, cur: OptionCost, nxt: OptionCost | None) -> np.ndarray:
    """:func:`advance` on many states at once, one :meth:`State.key` per row (the scheduler's
    partial plans); float64 arithmetic in the same order, so the result is the same to the bit."""
    depth = rows.shape[1] - SCALARS - 9
    k = SCALARS + depth  # where mem, excess, slot, hm, psi0, r, pend, nslot, tail start
    out = np.empty_like(rows)
    phi = rows[:, 0] + max(cur.a + cur.r, nxt.x if nxt is not None else 0.0)
    # psi gains block s+1's slot: its backward, or the copy of block s it overlaps.
    psi = rows[:, 1] + (max(nxt.b, cur.y) if nxt is not None else cur.y)  # last block: copy not overlapped
    late, m, pending = rows[:, 2], rows[:, 3], rows[:, SCALARS:k]
    if not cur.dha_fwd:  # this block's pre-forward issues the loads of the next `depth` non-DHA blocks
        late = np.maximum(late, phi + pending[:, 0])  # a -inf pending (none) leaves it as it was
        pending = np.concatenate([pending[:, 1:], np.full((len(rows), 1), _NEG)], axis=1)
    else:
        pending = pending.copy()
    # when its update may start: its gradient has landed (or the coefficient has: predict_clip_fired)
    land = (psi + cur.b + cur.d if cur.land is None else cur.land) if cur.host else None
    if cur.host and cur.by_deadline:  # due before every processed unit: its work delays each of them
        if cur.prefetch_fwd:
            pending[:, -1] = np.maximum(pending[:, -1], land)
        else:
            late = np.maximum(late, phi + land)
        late, pending = late + cur.h, pending + cur.h
    elif cur.host:  # after every processed unit
        m = np.maximum(m, land) + cur.h
        if cur.prefetch_fwd:
            pending[:, -1] = np.maximum(pending[:, -1], m)
        else:
            late = np.maximum(late, phi + m)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, SCALARS:k] = phi, psi, late, m, pending
    out[:, [k, k + 1, k + 5, k + 6]] = memory_rows(rows[:, [k, k + 1, k + 5, k + 6]], cur)
    out[:, k + 2] = np.maximum(rows[:, k + 2], cur.slot)
    out[:, k + 3] = rows[:, k + 3] + cur.hm
    # psi0: an earlier micro-batch's forward (phi's, without a stale resident block's reload)
    # and backward (psi's, without the device AdamW)
    fwd0 = max(cur.a0, nxt.x if nxt is not None else 0.0) if cur.a0 else 0.0
    out[:, k + 4] = rows[:, k + 4] + (max(nxt.b0, cur.y0) if nxt is not None else cur.y0) + fwd0
    out[:, k + 7] = slot_count(rows[:, k + 7], cur, depth)
    out[:, k + 8] = rows[:, k + 8] + cur.h_tail
    return out


def slot_count(nslot: np.ndarray, cur: OptionCost, depth: int) -> np.ndarray:
    """:class:`State`'s ``nslot`` after adding block ``cur``: one more where it is prefetched, at
    most ``depth + 1``; :func:`advance_rows` and the least-budget search both take it from here."""
    return np.minimum(nslot + (cur.slot > 0), depth + 1)


def memory_rows(rows: np.ndarray, cur: OptionCost) -> np.ndarray:
    """The memory columns ``(mem, excess, r, pend)`` of :class:`State` after adding block ``cur``
    below the processed ones (one partial plan per row); :func:`advance_rows` and the scheduler's
    least-budget search both take them from here."""
    mem, excess, r, pend = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    # this block's backward: the blocks above it have freed their activations and hold their gradients
    point = r + cur.trans
    if cur.fetch:  # brought back early, by the look-ahead of the offloaded block above (if any)
        excess, pend = np.maximum(np.maximum(excess, point), pend + cur.fetch), point
    else:  # below an offloaded block, its point holds the next offloaded block's fetch too
        excess, pend = np.maximum(excess, point), np.where(pend > _NEG, np.maximum(pend, point), pend)
    return np.stack([mem + (cur.persist + cur.act), excess, r + (cur.grads - cur.act), pend], axis=1)


@dataclass
class Prediction:
    """What the cost model predicts for a plan.

    Attributes:
        step_s: steady-state step time.
        peak_bytes: peak device memory, margin included.
        compute_s: compute-stream time of one step (the bound when nothing waits).
        host_optimizer_s: host AdamW work per step (accumulation and backups included).
        bound: ``"compute"``, ``"host optimizer"`` or ``"host memory"`` (which term set the
            step time).
        parts: named components (seconds / bytes) for explanations.
    """

    step_s: float
    peak_bytes: int
    compute_s: float
    host_optimizer_s: float
    bound: str
    parts: dict[str, float] = field(default_factory=dict)


def finish(state: State, first: OptionCost, profile: "StepProfile", links: Links, rest_optimizer: str,
           prefetch_depth: int, margin: float, fired_at: float | None = None) -> Prediction:
    """The prediction once every block is in ``state`` (``first`` is block 0's terms);
    ``fired_at``: a host-homed ``rest`` starts its update no earlier (:func:`predict_clip_fired`)."""
    rest_host = rest_optimizer == "host"
    h2d, d2h = links.h2d_GBps * 1e9, links.d2h_GBps * 1e9
    pre = (profile.rest_param_bytes / h2d if rest_host else 0.0) + first.x  # rest reload, block 0's copy
    psi = state.psi + first.b
    t_rest = profile.rest_fwd_s + profile.rest_bwd_s
    u_rest = 0.0 if rest_host else profile.rest_numel * profile.device_adamw_s_per_param
    # Accumulation: the micro-batches before the last run without updates or reloads (of rest or
    # of resident blocks: their host copies change only at the update), psi0's chains.
    one = first.x + t_rest + state.psi0 + first.b0  # an earlier micro-batch
    earlier = (max(1, profile.accumulation_steps) - 1) * one
    compute = pre + state.phi + t_rest + psi + u_rest + earlier
    terms = {"compute": compute}
    # Units released at begin_forward (the first loads, and rest) delay the whole forward.
    late = max(state.late, pre + state.phi + max(state.pending))
    budget = host_budget(profile, links)
    h_rest, _, hm_rest, tail_rest = rest_terms(profile, budget, rest_host)
    # The sums that start in the last earlier micro-batch have its compute to finish in; what
    # they overrun holds the host when the updates want it (session 40's 18 B form moved one
    # there and lost in session 41's rehearsals, where the model had counted it hidden). Not in
    # a step whose clip fires: its updates wait for the coefficient, after backward.
    spill = max(0.0, state.tail + tail_rest - one) if profile.accumulation_steps > 1 and fired_at is None else 0.0
    if rest_host:  # lands last (behind block 0's gradient on the d2h stream) and is due first
        land = max(psi + first.d + profile.rest_numel * profile.dtype_bytes / d2h, fired_at or 0.0)
        if first.by_deadline:  # it goes at once, and delays every block's update
            late = max(late, pre + state.phi + land) + h_rest
        else:  # it goes after every block's
            late = max(late, pre + state.phi + max(land, state.m) + h_rest)
    if late > _NEG:  # with what the rehearsal measured beyond the modelled wait (host_calibration.with_gap)
        terms["host optimizer"] = earlier + t_rest + late + spill + profile.host_gap_s
    if budget is not None:  # every host byte of the step, copies included, through one bandwidth
        terms["host memory"] = state.hm + hm_rest + profile.host_gap_s
    bound, step = max(terms.items(), key=lambda kv: kv[1])
    raw = int(peak_bytes(profile, rest_optimizer, prefetch_depth, state.mem, state.excess, state.slot, state.r,
                         state.nslot))
    return Prediction(step, int(raw * (1 + margin)), compute, 0.0, bound.split(" (")[0],
                      {**terms, "raw_peak_bytes": float(raw), "rest_s": t_rest, "forward_s": pre + state.phi,
                       "backward_s": psi, "earlier_micro_batches_s": earlier, "earlier_spill_s": spill,
                       "host_gap_s": profile.host_gap_s if late > _NEG or budget is not None else 0.0})


def predict_options(opts: Sequence[OptionCost], profile: "StepProfile", links: Links, rest_optimizer: str,
                    prefetch_depth: int, margin: float, fired_at: float | None = None) -> Prediction:
    """:func:`predict` from the blocks' terms (``host_optimizer_s`` left 0): the recurrence from
    the last block down, then :func:`finish` (``fired_at``: as it takes it)."""
    n = len(opts)
    state = initial_state(prefetch_depth)
    for s in range(n - 1, -1, -1):
        state = advance(state, opts[s], opts[s + 1] if s + 1 < n else None)
    return finish(state, opts[0], profile, links, rest_optimizer, prefetch_depth, margin, fired_at)


def _plan_options(plan: Plan, profile: "StepProfile", links: Links) -> list[OptionCost]:
    """The terms of each of ``plan``'s blocks; ValueError where it does not cover the profile's."""
    n = len(profile.blocks)
    if len(plan.units) != n:
        raise ValueError(f"the plan covers {len(plan.units)} blocks, the profile {n}")
    return [option_cost(profile, links, i, u, plan.prefetch_depth) for i, u in enumerate(plan.units)]


def predict_clip_fired(plan: Plan, profile: "StepProfile", links: Links, margin: float = 0.10) -> Prediction:
    """:func:`predict` for a step whose clip fires: no host update is kept before the coefficient
    lands, behind the last gradient copy (speculative ones are re-applied, the others wait), so
    every host-homed unit's update starts then, in the host's order, and the next forward waits
    for those it needs. A clipped step's own compute is unchanged: the difference from
    :func:`predict` shows in the step that follows it. The speculative updates' wasted host bytes
    are not counted.

    Raises:
        ValueError: the plan does not cover the profile's blocks.
    """
    opts = _plan_options(plan, profile, links)
    base = predict_options(opts, profile, links, plan.rest_optimizer, plan.prefetch_depth, margin)
    copies = [o.d for o in opts if o.host]
    if plan.rest_optimizer == "host":
        copies.append(profile.rest_numel * profile.dtype_bytes / (links.d2h_GBps * 1e9))
    at = base.parts["backward_s"] + max(copies, default=0.0)
    fired = [dataclasses.replace(o, land=at) if o.host else o for o in opts]
    return predict_options(fired, profile, links, plan.rest_optimizer, plan.prefetch_depth, margin, at)


def predict(plan: Plan, profile: "StepProfile", links: Links, margin: float = 0.10) -> Prediction:
    """Predicted step time and peak device memory of ``plan`` (see the module docstring).

    Raises:
        ValueError: the plan does not cover the profile's blocks.
    """
    opts = _plan_options(plan, profile, links)
    pred = predict_options(opts, profile, links, plan.rest_optimizer, plan.prefetch_depth, margin)
    h_rest, acc_rest, _, _ = rest_terms(profile, host_budget(profile, links), plan.rest_optimizer == "host")
    pred.host_optimizer_s = sum(o.h + o.h_acc for o in opts) + h_rest + acc_rest
    pred.parts["host_earlier_s"] = sum(o.h_acc for o in opts) + acc_rest  # within host_optimizer_s
    return pred


def describe_units(units: Sequence[UnitPlan]) -> str:
    """A short name for a list of unit plans (for notes)."""
    return ", ".join(_unit_name(u) for u in units)


def count_units(units: Sequence[UnitPlan]) -> str:
    """How many units take each plan, most first (``"96x prefetch/prefetch+r, 32x dha/dha+r"``):
    a long model's layout in a line."""
    counts = collections.Counter(_unit_name(u) for u in units)
    return ", ".join(f"{n}x {name}" for name, n in counts.most_common())


def _unit_name(u: UnitPlan) -> str:
    acts = {"keep": "", "recompute": "+r", "selective": "+s", "offload": "+o"}
    return (f"{u.forward}/{u.backward}{acts[u.activations]}"
            f"{'@dev' if u.optimizer == 'device' else ''}{'+devacc' if u.accumulate == 'device' else ''}")
