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
  DHA only in backward, with recompute) cost ``max(compute, bytes / dha rate) * penalty(M)``,
  the penalty from the probe's ``dha_matmul`` rows (cuBLAS re-reads host weights per output
  tile: docs/design.md §3). The first block's copy is not overlapped.
* **rest** (embeddings, head, loss) forward + backward between the passes: ``t_rest``.
* **backward**, blocks ``N-1..0``: ``psi_i = max(b_i, y_{i-1})`` with ``b`` recompute (in the
  backward mode) + backward + the device AdamW of a device-homed unit, ``y`` the copy of the
  next block. The last block keeps its forward copy when it is prefetched in both passes.
* **gradients** of a host-homed unit land ``d = grad bytes / d2h`` after its backward; one
  host worker runs AdamW (rate measured with the conversions) in landing order (blocks from
  last to first, ``rest`` last), each unit ``h = numel * host rate``.
* **next forward**: a host-homed unit's update must be done before the executor touches it:
  at its own pre-forward for DHA / resident units, when its prefetch is *issued* (the
  executor's ``opt.wait`` in ``_issue_load``, ``prefetch_depth`` blocks earlier, or at
  ``begin_forward`` for the first ones) for prefetched units, and at ``begin_forward`` for
  a host-homed ``rest`` (which is then reloaded before anything else runs).

With ``C`` the compute-stream time of one step and ``H_k`` the host worker's finish time of
unit ``k`` (from the step start), the steady-state period is the max-plus fixed point

    step = max(C, max_k (H_k - F_before(release point of k)))

(a unit released at the forward's block ``p`` delays only what follows ``p``). This closed
form is what :func:`predict` evaluates, with the exact recurrence the scheduler's dynamic
program uses (:func:`advance`, :func:`finish`), so the scheduler is optimal for this model.

Peak memory (bytes): resident ``rest`` (compute-dtype weights; + fp32 master and 2 moments
when device-homed) + per block (device-homed: the same 18 B/param in bf16; host-homed
resident: its weights) + saved activations of every block (only the block input with
recompute) + prefetch slots ``(depth + 1) * largest prefetched block`` + the largest of the
loss peak (logits in fp32 and their gradient: what OOMed the capped device12 run), one
block's backward transient (its recomputed activations + its gradients) beside ``rest``'s
gradients (held until backward's end), and a device-homed ``rest``'s update
(:func:`transient_bytes`), all times ``1 + margin`` for allocator fragmentation
(``memory_margin``: the only reserve; none is added on top; it also covers CUDA's rounding
and its cap on reserved bytes, docs/design.md §3.5). With gradient accumulation a
device-homed unit's fp32 gradient buffer is resident all step, not its update's transient
(:func:`grads_persist`). The loss peak is measured by the profiler on the model as it will
run, ``loss_chunks`` included, for our ``CausalLM`` (gpt, llama), ``HFCausalLM`` and Hugging
Face models computing their own loss alike; where it cannot be measured it is
:func:`loss_peak_estimate` of the head's shape. The head's weights are ``rest``'s, resident.

Activation offload (``UnitPlan.offload``): the block's saved activations leave on the d2h
stream during its forward (``a = max(a, act / d2h)``) and return on the h2d stream behind the
weights during backward (``y += act / h2d``); they hold no device memory in between, and two
blocks' worth (this one and the look-ahead) while backward passes. Saved tensors below
``OFFLOAD_MIN_BYTES`` stay (``act_bytes_offload_kept``).

Not modelled: link contention between prefetch copies, DHA reads and gradient copies (the
probe measures 92-98 GB/s duplex against 55 GB/s per direction); D2H queueing; a deeper
prefetch's smoothing of uneven blocks (depth only costs slots here); gradient clipping
(speculative by default, ``AdamW.clip_mode``: updates overlap backward as without it, but a
step whose clip fires re-applies them after backward; ``"wait"`` makes every update wait).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .config import Plan, UnitPlan

if TYPE_CHECKING:  # the profiler imports torch; the model itself needs only numbers
    from xpu import Backend

    from .profiler import StepProfile

__all__ = ["Links", "links_from_probe", "OptionCost", "option_cost", "Prediction", "predict", "State",
           "initial_state", "advance", "finish", "device_bytes_per_param", "H200_DHA_ROWS", "loss_peak_estimate",
           "auto_loss_chunks", "rest_resident_bytes", "transient_bytes", "grads_persist"]

#: DHA matmul slow-down against copy-then-matmul, by M (rows), measured on the H200
#: (docs/design.md §3: 8192x8192 bf16 weight; 2.66/2.49 ms at M=64, 5.3/2.5 at 256, 42/3.1 at 4096,
#: 391/5.2 at 16384). Used only when no probe with ``dha_matmul`` rows is cached.
H200_DHA_ROWS: tuple[tuple[int, float], ...] = ((64, 2.66 / 2.49), (256, 5.3 / 2.5), (4096, 42 / 3.1),
                                                (16384, 391 / 5.2))

_NEG = -math.inf


@dataclass(frozen=True)
class Links:
    """Measured transfer rates the cost model uses.

    Attributes:
        h2d_GBps: pinned host→device copy rate (10**9 B/s).
        d2h_GBps: pinned device→host copy rate.
        dha_read_GBps: rate of kernels reading pinned host memory (None: no DHA).
        dha_rows: ``(M, dha_ms / copy_then_matmul_ms)`` pairs, sorted by M.
        source: where the figures came from (``"probe"``, ``"topology"``, ``"given"``).
    """

    h2d_GBps: float
    d2h_GBps: float
    dha_read_GBps: float | None = None
    dha_rows: tuple[tuple[int, float], ...] = H200_DHA_ROWS
    source: str = "given"

    def dha_penalty(self, tokens: int) -> float:
        """How many times slower a DHA matmul is than copy-then-matmul at ``tokens`` rows.

        Linear in log M between the measured rows, clamped to the end rows, never below 1.
        """
        rows = sorted(self.dha_rows)
        if not rows:
            return 1.0
        if tokens <= rows[0][0]:
            return max(1.0, rows[0][1])
        if tokens >= rows[-1][0]:
            return max(1.0, rows[-1][1])
        for (m0, r0), (m1, r1) in zip(rows, rows[1:]):
            if m0 <= tokens <= m1:
                w = (math.log(tokens) - math.log(m0)) / (math.log(m1) - math.log(m0))
                return max(1.0, r0 + w * (r1 - r0))
        return max(1.0, rows[-1][1])  # unreachable: the rows are sorted


def links_from_probe(backend: "Backend", device: int | None = None, probe: dict[str, Any] | None = None) -> Links:
    """:class:`Links` from ``probe`` (default: ``xpu.probe.load_cached(backend)``).

    Without a cached probe, the topology's nominal host-link rate stands in for both copy
    directions (and for DHA where ``caps.dha``), with the H200 DHA penalty table.

    Raises:
        ValueError: no probe and the topology has no host link for ``device``.
    """
    if probe is None:
        from xpu.probe import load_cached

        probe = load_cached(backend)
    dha_ok = backend.caps.dha
    if probe and probe.get("h2d_pinned_GBps"):
        rows = tuple(sorted((int(r["M"]), float(r["dha_ms"]) / float(r["copy_then_matmul_ms"]))
                            for r in probe.get("dha_matmul", []) if r.get("dha_ms") and r.get("copy_then_matmul_ms")))
        return Links(float(probe["h2d_pinned_GBps"]), float(probe.get("d2h_pinned_GBps") or probe["h2d_pinned_GBps"]),
                     float(probe["dha_read_GBps"]) if dha_ok and probe.get("dha_read_GBps") else None,
                     rows or H200_DHA_ROWS, "probe")
    index = backend.index_of(device)
    link = backend.topology().host_link(index)
    if link is None:
        raise ValueError(f"no probe is cached for backend '{backend.name}' and its topology has no host link for "
                         f"device {index}; run `xpu probe` first")
    return Links(link.GBps, link.GBps, link.GBps if dha_ok else None, H200_DHA_ROWS, "topology")


def device_bytes_per_param(dtype_bytes: int, with_grad: bool = False) -> int:
    """Device bytes per parameter of a device-homed unit, as ``ShadowModel`` allocates them:
    compute-dtype weights, fp32 master (the same buffer in fp32) and two fp32 moments (14 B in
    bf16, 12 B in fp32), plus the fp32 gradient buffer (4 B) ``with_grad``, which holds memory
    only while the unit's update runs without accumulation, and from the step's first
    micro-batch to the update with it (:func:`grads_persist`)."""
    return dtype_bytes + (0 if dtype_bytes == 4 else 4) + 8 + (4 if with_grad else 0)


def grads_persist(profile: "StepProfile") -> bool:
    """Whether device-homed units' fp32 gradient buffers stay allocated all step: with
    ``accumulation_steps > 1`` the ``DeviceOptimizer`` sums micro-batches into the buffer and
    frees it after the update (Qwen2-1.5B's device-homed tied head: 934 MB, resident through
    every later micro-batch; counted as a transient, an 8 GB plan ran out of memory)."""
    return getattr(profile, "accumulation_steps", 1) > 1


def loss_peak_estimate(tokens: int, vocab: int, hidden: int, chunks: int = 1, dtype_bytes: int = 4) -> int:
    """Device bytes the head and loss add at their peak, from their shapes: an upper estimate
    of what the profiler measures (on the tiny test models it is 5-50 % above the measured).

    The account, for ``chunks`` token slices (``loss_chunks``; each slice's logits recomputed
    in backward): one slice's logits in fp32, their log-softmax and their gradient (3 x 4 B
    per logit), plus the compute-dtype logits and their gradient where that is not fp32; the
    head weight's gradient, one slice's contribution to it before accumulation, and (tied
    to the input embedding) the lookup's dense gradient (3 x vocab x hidden in the compute
    dtype); the final hidden states and their gradient (2 x tokens x
    hidden). The head's weights themselves are the ``rest`` unit's, always resident on the
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


@dataclass(frozen=True)
class OptionCost:
    """One block under one :class:`UnitPlan`: the per-block terms of the cost model.

    Times in seconds, sizes in bytes. ``a``: forward compute; ``r``: un-overlapped reload of
    a stale host-homed resident block; ``x``: forward copy (overlaps the previous block);
    ``b``: backward (recompute + backward + device AdamW); ``y``: backward copy (overlaps the
    next-later block's backward); ``d``: gradient copy to the host; ``h``: host AdamW;
    ``persist``: device bytes held all step; ``act``: saved activations; ``trans``:
    backward transient; ``slot``: prefetch buffer size (0 if never prefetched).
    """

    a: float
    r: float
    x: float
    b: float
    y: float
    d: float
    h: float
    persist: int
    act: int
    trans: int
    slot: int
    host: bool
    prefetch_fwd: bool
    dha_fwd: bool


#: Streamed host_linear against the bare link time of its weight (H200: 2.64 ms against 2.33 ms
#: for 128 MiB at M=4096, bench/scripts/diag_dha_linear.py).
STREAM_OVERHEAD = 1.15
#: Share of the shorter of (compute, link) that host_linear's backward adds to the longer one.
#: Fitted on the H200 (8192x8192 bf16 weight, ring gradient write): backward 3.1 / 3.4 / 8.5 ms
#: measured at M = 1024 / 4096 / 16384, 3.0 / 3.5 / 7.4 ms modelled (diag_dha_linear.py,
#: 2026-12-01).
RING_SERIAL = 0.5


def _mode_time(mode: str, base: float, nbytes: int, links: Links, penalty: float) -> float:
    """A pass of plain kernels whose weights are bound in ``mode``."""
    if mode != "dha":
        return base
    if not links.dha_read_GBps:
        return math.inf  # no DHA here: never chosen
    return max(base, nbytes / (links.dha_read_GBps * 1e9)) * penalty


def _ring_bytes(tokens: int) -> int:
    """Device memory of host_linear's ring while it streams (none when in place): backward
    holds two weight slots and two gradient slots."""
    from .dha_linear import CHUNK_BYTES, DHA_MAX_ROWS

    return 4 * CHUNK_BYTES if tokens > DHA_MAX_ROWS else 0


def _host_linear_time(base: float, nbytes: int, links: Links, tokens: int, backward: bool) -> float:
    """A pass of a block whose linears run as ``host_linear`` (forward mode DHA)."""
    from .dha_linear import DHA_MAX_ROWS

    if not links.dha_read_GBps:
        return math.inf
    if tokens <= DHA_MAX_ROWS:  # read in place: one GEMM tile, each byte crosses once
        return max(base, nbytes / (links.dha_read_GBps * 1e9) * (2 if backward else 1))
    if not backward:
        return max(base, STREAM_OVERHEAD * nbytes / (links.h2d_GBps * 1e9))
    # Backward: the weight in (for dX) and its gradient out through the ring share the
    # full-duplex link; the ring's slot waits put part of the compute in series with it.
    link = STREAM_OVERHEAD * nbytes / (min(links.h2d_GBps, links.d2h_GBps) * 1e9)
    return max(base, link) + RING_SERIAL * min(base, link)


def option_cost(profile: "StepProfile", links: Links, index: int, unit: UnitPlan, prefetch_depth: int = 1) -> OptionCost:
    """The cost-model terms of block ``index`` run as ``unit`` (see :class:`OptionCost`)."""
    blk = profile.blocks[index]
    n = len(profile.blocks)
    w = blk.param_bytes
    pen = links.dha_penalty(profile.tokens)
    h2d, d2h = links.h2d_GBps * 1e9, links.d2h_GBps * 1e9
    host = unit.optimizer == "host"
    resident = unit.forward == "resident"
    if unit.forward == "dha":  # host_linear in both passes (a recomputation replays forward's ops)
        a = _host_linear_time(blk.fwd_s, w, links, profile.tokens, backward=False)
        b = _host_linear_time(blk.bwd_s, w, links, profile.tokens, backward=True)
        if unit.recompute:
            b += a
    else:
        a = _mode_time(unit.forward, blk.fwd_s, w, links, pen)
        b = _mode_time(unit.backward, blk.bwd_s, w, links, pen)
        if unit.recompute:  # recomputation reads weights the way backward does (its hook binds them)
            b += _mode_time(unit.backward, blk.fwd_s, w, links, pen)
    if not host:
        b += blk.numel * profile.device_adamw_s_per_param
    # The executor keeps the last `depth` blocks' forward copies for backward when both passes prefetch.
    kept = unit.forward == unit.backward == "prefetch" and index >= n - prefetch_depth
    grad_bytes = blk.numel * profile.dtype_bytes
    held = grads_persist(profile)  # the fp32 gradient buffer: resident all step, or only in backward
    if not host:
        persist = blk.numel * device_bytes_per_param(profile.dtype_bytes, with_grad=held)
    else:
        persist = w if resident else 0
    off_out = off_in = 0.0
    if unit.offload:  # saved activations out on the d2h stream during forward, back before backward
        off_out, off_in = blk.act_bytes / d2h, blk.act_bytes / h2d
    return OptionCost(
        a=max(a, off_out),
        r=w / h2d if resident and host else 0.0,
        x=w / h2d if unit.forward == "prefetch" else 0.0,
        b=b,
        y=(w / h2d if unit.backward == "prefetch" and not kept else 0.0) + off_in,
        d=grad_bytes / d2h if host else 0.0,
        h=blk.numel * profile.host_adamw_s_per_param if host else 0.0,
        persist=persist,
        # offload leaves the saved tensors below the swapper's threshold on the device
        act=blk.act_bytes_recompute if unit.recompute else blk.act_bytes_offload_kept if unit.offload else blk.act_bytes,
        # recompute: the block's activations rebuilt in backward; offload: this block's and the
        # next one's (look-ahead) back on the device
        trans=(blk.act_bytes if unit.recompute else 2 * blk.act_bytes if unit.offload else 0) + grad_bytes
        + (0 if host or held else blk.numel * 4)
        + (_ring_bytes(profile.tokens) if unit.forward == "dha" else 0),
        slot=w if "prefetch" in (unit.forward, unit.backward) else 0,
        host=host,
        prefetch_fwd=unit.forward == "prefetch",
        dha_fwd=unit.forward == "dha",
    )


@dataclass(frozen=True)
class State:
    """What the blocks processed so far (from the last block down) contribute.

    All fields are non-decreasing under :func:`advance` and the prediction is non-decreasing
    in each, which is what makes Pareto pruning in the scheduler exact.

    Attributes:
        phi: forward compute-stream time of the processed blocks (from the current block on).
        psi: backward time before the current block's backward starts (first-block stall
            included), counted from the start of backward.
        m: host worker's finish time of the last processed host unit, from backward start.
        t: max over released host units of (remaining forward after its release + its finish).
        pending: host finish times of prefetched units whose release point is still ahead
            (``pending[j]``: released at the (j+1)-th non-DHA block further down).
        mem: persistent + activation bytes; trans: largest backward transient; slot: largest
            prefetched block.
    """

    phi: float
    psi: float
    m: float
    t: float
    pending: tuple[float, ...]
    mem: int
    trans: int
    slot: int

    def key(self) -> tuple[float, ...]:
        """The components, for dominance checks."""
        return (self.phi, self.psi, self.m, self.t, *self.pending, float(self.mem), float(self.trans), float(self.slot))


def initial_state(prefetch_depth: int) -> State:
    """Nothing processed yet."""
    return State(0.0, 0.0, _NEG, _NEG, (_NEG,) * prefetch_depth, 0, 0, 0)


def advance(state: State, cur: OptionCost, nxt: OptionCost | None) -> State:
    """Add block ``s`` (``cur``) below the processed blocks ``s+1..N-1`` (``nxt`` is block s+1's
    terms, None when ``s`` is the last block)."""
    phi = state.phi + max(cur.a + cur.r, nxt.x if nxt is not None else 0.0)
    # psi gains block s+1's slot: its backward, or the copy of block s it overlaps.
    psi = state.psi + (max(nxt.b, cur.y) if nxt is not None else cur.y)  # last block: copy not overlapped
    m, t, pending = state.m, state.t, list(state.pending)
    if not cur.dha_fwd:  # this block's pre-forward issues the loads of the next `depth` non-DHA blocks
        if pending[0] > _NEG:
            t = max(t, phi + pending[0])
        pending = pending[1:] + [_NEG]
    if cur.host:
        m = max(m, psi + cur.b + cur.d) + cur.h
        if cur.prefetch_fwd:
            pending[-1] = max(pending[-1], m)
        else:
            t = max(t, phi + m)
    return State(phi, psi, m, t, tuple(pending), state.mem + cur.persist + cur.act, max(state.trans, cur.trans),
                 max(state.slot, cur.slot))


@dataclass
class Prediction:
    """What the cost model predicts for a plan.

    Attributes:
        step_s: steady-state step time.
        peak_bytes: peak device memory, margin included.
        compute_s: compute-stream time of one step (the bound when nothing waits).
        host_optimizer_s: host AdamW work per step.
        bound: ``"compute"`` or ``"host optimizer"`` (which term set the step time).
        parts: named components (seconds / bytes) for explanations.
    """

    step_s: float
    peak_bytes: int
    compute_s: float
    host_optimizer_s: float
    bound: str
    parts: dict[str, float] = field(default_factory=dict)


def finish(state: State, first: OptionCost, profile: "StepProfile", links: Links, rest_optimizer: str,
           prefetch_depth: int, margin: float) -> Prediction:
    """The prediction once every block is in ``state`` (``first`` is block 0's terms)."""
    rest_host = rest_optimizer == "host"
    h2d, d2h = links.h2d_GBps * 1e9, links.d2h_GBps * 1e9
    pre = (profile.rest_param_bytes / h2d if rest_host else 0.0) + first.x  # rest reload, block 0's copy
    psi = state.psi + first.b
    t_rest = profile.rest_fwd_s + profile.rest_bwd_s
    u_rest = 0.0 if rest_host else profile.rest_numel * profile.device_adamw_s_per_param
    compute = pre + state.phi + t_rest + psi + u_rest
    terms = {"compute": compute}
    if state.t > _NEG:
        terms["host optimizer"] = t_rest + state.t
    begin = max(state.pending)
    if begin > _NEG:  # released at begin_forward: the whole forward waits
        terms["host optimizer (first loads)"] = pre + state.phi + t_rest + begin
    h_rest = profile.rest_numel * profile.host_adamw_s_per_param if rest_host else 0.0
    if rest_host:
        land = pre + state.phi + t_rest + psi + profile.rest_numel * profile.dtype_bytes / d2h
        terms["host optimizer (rest)"] = max(land, pre + state.phi + t_rest + state.m) + h_rest
    bound, step = max(terms.items(), key=lambda kv: kv[1])
    raw = (rest_resident_bytes(profile, rest_optimizer) + profile.input_bytes + state.mem
           + (prefetch_depth + 1) * state.slot + transient_bytes(profile, rest_optimizer, state.trans))
    return Prediction(step, int(raw * (1 + margin)), compute, 0.0, bound.split(" (")[0],
                      {**terms, "raw_peak_bytes": float(raw), "rest_s": t_rest, "forward_s": pre + state.phi,
                       "backward_s": psi})


def rest_resident_bytes(profile: "StepProfile", rest_optimizer: str) -> int:
    """Device bytes ``rest`` (embeddings, head, final norm) holds all step: its compute-dtype
    weights, plus the fp32 master and moments when it is device-homed, and then its fp32
    gradient buffer too under gradient accumulation (:func:`grads_persist`; without it the
    buffer is a transient: :func:`transient_bytes`)."""
    per = (device_bytes_per_param(profile.dtype_bytes, with_grad=grads_persist(profile)) if rest_optimizer == "device"
           else profile.dtype_bytes)
    return profile.rest_numel * per


def transient_bytes(profile: "StepProfile", rest_optimizer: str, trans: int) -> int:
    """The largest of what comes and goes on top of the resident bytes, given ``trans`` (the
    largest block backward transient):

    * the loss (``loss_peak_bytes``: one slice's fp32 logits, their log-softmax and gradient,
      the head's weight gradient, the hidden-state gradient; measured with ``loss_chunks``);
    * a block's backward, beside ``rest``'s gradients: they stay on the device until its last
      one lands (the input embedding's, at backward's end; a tied head's is that same one);
    * ``rest``'s update when device-homed: its gradients upcast into the fp32 buffer (already
      resident under gradient accumulation: :func:`rest_resident_bytes`).
    """
    rest_grads = profile.rest_numel * profile.dtype_bytes
    end = rest_grads + (profile.rest_numel * 4 if rest_optimizer == "device" and not grads_persist(profile) else 0)
    return max(profile.loss_peak_bytes, trans + rest_grads, end)


def predict(plan: Plan, profile: "StepProfile", links: Links, margin: float = 0.10) -> Prediction:
    """Predicted step time and peak device memory of ``plan`` (see the module docstring).

    Raises:
        ValueError: the plan does not cover the profile's blocks.
    """
    n = len(profile.blocks)
    if len(plan.units) != n:
        raise ValueError(f"the plan covers {len(plan.units)} blocks, the profile {n}")
    opts = [option_cost(profile, links, i, u, plan.prefetch_depth) for i, u in enumerate(plan.units)]
    state = initial_state(plan.prefetch_depth)
    for s in range(n - 1, -1, -1):
        state = advance(state, opts[s], opts[s + 1] if s + 1 < n else None)
    pred = finish(state, opts[0], profile, links, plan.rest_optimizer, plan.prefetch_depth, margin)
    pred.host_optimizer_s = sum(o.h for o in opts) + (
        profile.rest_numel * profile.host_adamw_s_per_param if plan.rest_optimizer == "host" else 0.0)
    return pred


def describe_units(units: Sequence[UnitPlan]) -> str:
    """A short name for a list of unit plans (for notes)."""
    return ", ".join(f"{u.forward}/{u.backward}{'+r' if u.recompute else ''}{'+o' if u.offload else ''}"
                     f"{'@dev' if u.optimizer == 'device' else ''}"
                     for u in units)
