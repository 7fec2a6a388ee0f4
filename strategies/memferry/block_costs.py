"""The cost model's terms of one block run as one :class:`~.config.UnitPlan` (:class:`OptionCost`).

What a block's forward, backward, copies and host update take, and the device bytes it holds,
from the profiled block and the links: the inputs of :mod:`strategies.memferry.cost`'s
recurrence (its docstring says how they combine into a step and a peak).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .accumulation import sums_in_pairs
from .clip_norms import norm_on_device
from .compiled_blocks import block_as_run
from .config import UnitPlan
from .host_budget import host_budget, link_bytes, unit_terms
from .links import Links
from .memory_terms import device_bytes_per_param, device_sum_bytes, grads_persist, held_grad_bytes

if TYPE_CHECKING:
    from .profiler import BlockProfile, StepProfile

__all__ = ["OptionCost", "option_cost", "sums_on_host_by_choice", "STREAM_OVERHEAD", "DEVICE_ADD_SHARE", "RING_SERIAL",
           "DHA_VIEW_CONTENTION"]


@dataclass(frozen=True)
class OptionCost:
    """One block under one :class:`UnitPlan`: the per-block terms of the cost model.

    Times in seconds, sizes in bytes. ``a``: forward compute; ``r``: un-overlapped reload of
    a stale host-homed resident block; ``x``: forward copy (overlaps the previous block);
    ``b``: backward (recompute + backward + device AdamW); ``y``: backward copy (overlaps the
    next-later block's backward); ``d``: gradient copy to the host; ``h``: host AdamW once
    the last gradient landed; ``h_acc``: host work of earlier micro-batches, ``h_tail`` the part
    of it that starts in the last earlier one (``host_budget.HostTerms.tail``); ``hm``: the
    block's host-memory seconds per step (``host_budget``); ``a0``, ``b0``, ``y0``: ``a``,
    ``b`` without the device AdamW and ``y``, as an earlier micro-batch of an accumulated step
    runs them (0 without accumulation; such a micro-batch reloads no resident block, ``r``: its
    host copy changes only at the step's update); ``by_deadline``: the host takes updates in
    deadline order (``StepProfile.host_order``);
    ``persist``: device bytes held all step; ``grads``: gradient bytes held from the block's
    backward to the step's end (a device-homed unit under clipping alone: ``held_grad_bytes``);
    ``act``: saved activations, held from its forward to its backward (which frees them);
    ``trans``: backward transient; ``fetch``: an offloaded block's activations fetched back
    early, during the backward of the blocks down from the offloaded block above it (the
    swapper's look-ahead), 0 otherwise; ``slot``: prefetch buffer size (0 if never prefetched); ``land``: when
    the host may start its update, from backward's start (None: once its gradient has landed;
    a step whose clip fires sets the coefficient's landing: ``cost.predict_clip_fired``).
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
    h_acc: float = 0.0
    hm: float = 0.0
    h_tail: float = 0.0
    a0: float = 0.0
    b0: float = 0.0
    y0: float = 0.0
    by_deadline: bool = False
    grads: int = 0
    fetch: int = 0
    land: float | None = None


#: Streamed host_linear against the bare link time of its weight (H200: 2.64 ms against 2.33 ms
#: for 128 MiB at M=4096, bench/scripts/diag_dha_linear.py).
STREAM_OVERHEAD = 1.15
#: A device add of a 16-bit gradient into an fp32 sum moves 10 B per parameter, a quarter of the
#: ~40 B the device AdamW (upcast, update, write-back) moves: its time, from the profiled rate.
DEVICE_ADD_SHARE = 0.25
#: Share of the shorter of (compute, link) that host_linear's backward adds to the longer one.
#: Fitted on the H200 (8192x8192 bf16 weight, ring gradient write): backward 3.1 / 3.4 / 8.5 ms
#: measured at M = 1024 / 4096 / 16384, 3.0 / 3.5 / 7.4 ms modelled (diag_dha_linear.py,
#: 2026-12-01).
RING_SERIAL = 0.5
#: Plain kernels over a DHA view (a block DHA only in backward) in a step, against the probe's
#: rate alone: their re-reads of host memory meet the host optimizer's (a DHA block is host-
#: updated, so such a step always updates on the host). On the H200 the three 8 GB plans with
#: such a block ran 14-28 % over their predictions, by about the block's whole predicted backward
#: (65 and 69 ms predicted; the steps 45 and 66 ms over), while plans without one came within
#: 1-7 % (sessions 12, 18, 26; bench/results/2026-12-04-h200-session26/README.md).
DHA_VIEW_CONTENTION = 2.0


def _mode_time(mode: str, base: float, nbytes: int, links: Links, penalty: float) -> float:
    """A pass of plain kernels whose weights are bound in ``mode`` (DHA: re-read from host
    memory per tile, ``penalty``, beside the host optimizer: :data:`DHA_VIEW_CONTENTION`)."""
    if mode != "dha":
        return base
    if not links.dha_read_GBps:
        return math.inf  # no DHA here: never chosen
    return max(base, nbytes / (links.dha_read_GBps * 1e9)) * penalty * DHA_VIEW_CONTENTION


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
    # Its chunks cross the link while the host optimizer streams host memory: no faster than
    # the probe's copies beside such traffic (both ways at once, as backward's weight in and
    # gradient out). At 1.15x the bare link time the 8 GB GPT's nine such blocks were priced
    # 2.11 ms a pass and its step missed by 17.8 %; at the loaded rate (4.75 ms) its plan is
    # predicted within 1 % (H100, 21 GB/s a direction under load;
    # bench/results/2026-12-05-h100-session35/call1/replay-dha.md).
    loaded = nbytes / (links.loaded_copy_GBps * 1e9) if links.loaded_copy_GBps else 0.0
    if not backward:
        return max(base, STREAM_OVERHEAD * nbytes / (links.h2d_GBps * 1e9), loaded)
    # Backward: the weight in (for dX) and its gradient out through the ring share the
    # full-duplex link; the ring's slot waits put part of the compute in series with it.
    link = max(STREAM_OVERHEAD * nbytes / (min(links.h2d_GBps, links.d2h_GBps) * 1e9), loaded)
    return max(base, link) + RING_SERIAL * min(base, link)


def _backward_bytes(blk: "BlockProfile", unit: UnitPlan, grad_bytes: int) -> int:
    """What a block's backward under ``unit`` holds beyond what its forward kept (at least its
    weights' gradients). A recomputed block's is profiled as the executor runs it (its rebuilt
    activations freed as backward goes, its input shared with what it kept); where a profile
    has no such figure, all its activations are counted beside the keeping backward's."""
    measured = blk.bwd_selective_bytes if unit.selective else blk.bwd_recompute_bytes if unit.recompute else 0
    if measured:
        return max(grad_bytes, measured)
    return (blk.act_bytes if unit.recompute or unit.offload else 0) + max(grad_bytes, blk.bwd_extra_bytes)


def _kept_bytes(blk: "BlockProfile", unit: UnitPlan) -> int:
    """Device bytes the block's forward leaves for its backward under ``unit``."""
    if unit.recompute:
        return blk.act_bytes_selective if unit.selective else blk.act_bytes_recompute
    return blk.act_bytes_offload_kept if unit.offload else blk.act_bytes


def sums_on_host_by_choice(unit: UnitPlan) -> bool:
    """Whether ``unit`` sums accumulated micro-batches on the host where it could on the device
    (host-updated, neither pass DHA, ``accumulate`` left to the host)."""
    return unit.optimizer == "host" and unit.accumulate != "device" and "dha" not in (unit.forward, unit.backward)


def option_cost(profile: "StepProfile", links: Links, index: int, unit: UnitPlan, prefetch_depth: int = 1) -> OptionCost:
    """The cost-model terms of block ``index`` run as ``unit`` (see :class:`OptionCost`)."""
    blk = block_as_run(profile, index, unit)  # eager figures where a compiled profile's block stays eager
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
        # selective: its dispatch mode slows forward too (profiles without that figure: fwd_s)
        a = _mode_time(unit.forward, (blk.fwd_selective_s or blk.fwd_s) if unit.selective else blk.fwd_s, w, links, pen)
        if unit.selective:  # the cheap ops recomputed inside backward (profiled together); unmeasured: never chosen
            b = blk.bwd_selective_s if blk.act_bytes_selective else math.inf
        else:
            b = _mode_time(unit.backward, blk.bwd_s, w, links, pen)
        if unit.recompute and not unit.selective:  # it reads weights the way backward does (its hook binds them)
            b += _mode_time(unit.backward, blk.recompute_time, w, links, pen)
    u = 0.0 if host else blk.numel * profile.device_adamw_s_per_param
    # Summing micro-batches on the device (accumulate="device"): an fp32 add per micro-batch, and
    # the sum goes home once, 4 B per parameter; a plan the executor refuses never wins.
    summed = host and unit.accumulate == "device"
    if summed and (profile.accumulation_steps < 2 or "dha" in (unit.forward, unit.backward)):
        a = math.inf
    b += u + (blk.numel * profile.device_adamw_s_per_param * DEVICE_ADD_SHARE if summed else 0.0)
    # The executor keeps the last `depth` blocks' forward copies for backward when both passes prefetch.
    kept = unit.forward == unit.backward == "prefetch" and index >= n - prefetch_depth
    grad_bytes = blk.numel * profile.dtype_bytes
    held = grads_persist(profile)  # the fp32 gradient buffer: resident all step, or only in its update
    # With clipping alone a device-homed unit holds the gradient autograd made from its backward
    # to step(): not all step (``grads``; cost.State.excess and r place it).
    grads = 0 if host or held else blk.numel * held_grad_bytes(profile)
    if not host:  # all its weights (a LoRA base's too), then master, moments and gradient per trainable parameter
        per = device_bytes_per_param(profile.dtype_bytes, held_grad_bytes(profile) if held else 0)
        persist = w + blk.numel * (per - profile.dtype_bytes)
    else:
        persist = (w if resident else 0) + (device_sum_bytes(blk.numel) if summed else 0)
    bwd = _backward_bytes(blk, unit, grad_bytes)
    off_out = off_in = 0.0
    if unit.offload:  # saved activations out on the d2h stream during forward, back before backward
        off_out, off_in = blk.act_bytes / d2h, blk.act_bytes / h2d
    y = (w / h2d if unit.backward == "prefetch" and not kept else 0.0) + off_in
    d = (device_sum_bytes(blk.numel) if summed else grad_bytes) / d2h if host else 0.0
    h, h_acc, hm, h_tail = unit_terms(profile, host_budget(profile, links), blk.numel, host,
                                      link_bytes(unit, w, grad_bytes, blk.act_bytes, kept, host), max(b, y, d), summed,
                                      sums_in_pairs(unit, profile.data_parallel),
                                      not norm_on_device(unit, profile.accumulation_steps, profile.data_parallel))
    accumulated = profile.accumulation_steps > 1
    return OptionCost(
        a=max(a, off_out),
        r=w / h2d if resident and host else 0.0,
        x=w / h2d if unit.forward == "prefetch" else 0.0,
        b=b,
        y=y,
        d=d,
        h=h,
        persist=persist,
        grads=grads,
        # offload leaves the saved tensors below the swapper's threshold on the device
        act=_kept_bytes(blk, unit),
        fetch=blk.act_bytes - _kept_bytes(blk, unit) if unit.offload else 0,
        # what its backward makes on top of what it kept (intermediate gradients and its
        # weights'; recompute: the activations it rebuilds, as profiled in that mode); offload:
        # its activations back on the device (the next offloaded block's, fetched with them,
        # are ``fetch``: cost.State.pend places them). A device-homed unit updates into an fp32
        # buffer (resident where ``held``) once its gradients are in, when its backward's
        # transient is gone but for them and its input's gradient.
        trans=(bwd if host or held else max(bwd, grad_bytes + blk.numel * 4 + blk.act_bytes_recompute))
        + (grad_bytes if host and not summed and profile.flat_sends and not profile.data_parallel else 0)  # gathered for one copy home
        + (_ring_bytes(profile.tokens) if unit.forward == "dha" else 0),
        slot=w if "prefetch" in (unit.forward, unit.backward) else 0,
        host=host,
        prefetch_fwd=unit.forward == "prefetch",
        dha_fwd=unit.forward == "dha",
        h_acc=h_acc,
        h_tail=h_tail,
        hm=hm,
        a0=max(a, off_out) if accumulated else 0.0,
        # an earlier micro-batch sends a host-summing block's gradients home: the issuing thread's time
        b0=b - u + (profile.earlier_send_s if sums_on_host_by_choice(unit) else 0.0) if accumulated else 0.0,
        y0=y if accumulated else 0.0,
        by_deadline=profile.host_order == "deadline",
    )
