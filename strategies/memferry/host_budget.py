"""MemFerry's host-memory budget: the host optimizer and every host-link copy share one DRAM.

A DMA byte is a host-memory byte: a prefetch reads host memory, a gradient copy or an
activation offload writes it, a DHA kernel reads it. On the H200 machine a single-pass host
AdamW took 0.24 ns per parameter alone and 0.33 while both copy directions ran at full rate
(docs/design.md §3.3). This module turns bytes into host-memory seconds for the cost model:

* **Update bytes** per host-updated parameter per step (:func:`update_bytes`): the AdamW pass
  reads the gradient, reads and writes the fp32 master and both moments and writes the
  compute-dtype copy (28 B in bf16, 28 B in fp32 where the master is the copy); under
  ``accumulation_steps`` N > 1 the micro-batches are summed into an fp32 buffer on the host
  (the first copied: 4 + g bytes, each later one added: 8 + g; or two at a time where the
  engine pairs them: 4 + 2g for the first pair, 8 + 2g for each later one) and the pass reads
  that fp32 sum (without clipping a last pair is not summed: the pass reads it and the sum
  before it, 4 + 2g instead of 4 + (8 + 2g), or of two the pair alone, 2g; of an odd count the
  last 16-bit micro-batch is not summed: the pass reads it beside the sum; a unit planned
  ``accumulate="device"`` sums on the device instead: the host only receives the fp32 sum, 4 B per
  parameter over the link once a step, and the pass reads it);
  speculative clipping updates a 16-bit-compute unit into a spare master and moments (no bytes
  more) but writes an fp32-compute unit's old master and moments to a backup in the update's own
  sweep (12 B written; ``speculative_clip.py``), and clipping reads the gradient once more for
  its norm where the device cannot sum its squares (``clip_norms.norm_on_device``). A clipped step's re-application from the backups is not counted (it
  happens only in steps whose norm exceeds the limit). A split update (``split_update.py``:
  accumulation, 16-bit compute) writes the working copy and the fp32 gradient
  (4 B) instead of the master and moments once the last gradient has landed, and reads that
  gradient and the master and moments and writes them back (28 B) while the next step's
  earlier micro-batches run.
* **Bandwidth** B: ``xpu probe``'s triad on all cores (``Links.host_GBps``), else what the
  measured kernel itself moved alone. The kernel's bytes weigh ``kernel_weight`` =
  (its time alone) x B / (its bytes): 1 for a kernel at triad speed. Accumulation, backups and
  the norm are plain streaming passes and weigh 1.
* **Copies** cost the host ``copy_weight`` (kappa) host-memory bytes per link byte: from the
  profiler's timing of the kernel alone (s_a) and beside full-rate copies in both directions
  (s_c, while they moved D bytes/s): ``kappa = B (1 - s_a / s_c) / D``; where the profile has
  no such timing (virtual devices), from the probe's triad alone and beside copies; else 0.
  Host-memory work of W bytes beside copies moving D bytes/s takes ``W / (B - kappa D)``, and
  no more than ``(W + kappa C) / B`` when the C bytes of copies end before it does.

The rehearsal calibrates both parts, the work once a unit's last gradient has landed and the
earlier micro-batches' sums, to what they took in real steps (``host_calibration.py``:
``HostBudget.update_scale``, ``earlier_scale``).

The cost model uses it twice: each host update's time in the host worker's chain, beside
the copies of its block's backward (:func:`unit_terms`), and one throughput bound for the
whole step, ``(all update bytes + kappa x all link bytes) / B`` (the ``host memory`` term).
Profiles written before the byte fields (``host_adamw_bytes_per_param`` 0) keep the old
model: updates at their measured in-step rate, no host-memory term.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .config import UnitPlan

if TYPE_CHECKING:
    from .links import Links
    from .profiler import StepProfile

__all__ = ["UpdateBytes", "update_bytes", "HostBudget", "host_budget", "link_bytes", "HostTerms", "unit_terms",
           "rest_terms", "MIN_SHARE"]

#: fp32 master, exp_avg and exp_avg_sq, each read and written by the update.
STATE_BYTES = 24
#: The fp32 accumulation buffer's element.
ACC_BYTES = 4
#: Speculative clipping's backup: the old fp32 master and moments written in the update's sweep
#: (fp32 compute only: a 16-bit-compute unit updates into its spare instead).
BACKUP_BYTES = 12
#: The least share of the bandwidth host work keeps beside any copy load (a floor on the
#: linear model: copies never stop the CPU outright).
MIN_SHARE = 0.1


@dataclass(frozen=True)
class UpdateBytes:
    """Host-memory bytes per host-updated parameter per step, by what moves them.

    Attributes:
        kernel: the AdamW pass (gradient read, master and moments read and written,
            compute-dtype copy written).
        accumulate_final: summing the last micro-batch, just before the pass (0 with one).
        accumulate_earlier: summing the earlier micro-batches, while they run.
        backup: speculative clipping's copy of master and moments (written in the update's sweep).
        norm: clipping's read of the gradient for its norm.
        deferred: a split update's second pass, done during the next step's earlier
            micro-batches (kernel bytes).
        accumulate_tail: among ``accumulate_earlier``, the sum that starts in the step's last
            earlier micro-batch (it lands there): it has that micro-batch's compute, not two, to
            finish in before the updates want the host (``cost.finish`` counts what it overruns).
    """

    kernel: int
    accumulate_final: int = 0
    accumulate_earlier: int = 0
    backup: int = 0
    norm: int = 0
    deferred: int = 0
    accumulate_tail: int = 0

    @property
    def final(self) -> int:
        """What the host does for the parameter once its last gradient has landed."""
        return self.kernel + self.accumulate_final + self.backup + self.norm

    @property
    def timed(self) -> int:
        """What ``HostOptimizer.measured_s_per_param`` times (all but the norm's read)."""
        return self.kernel + self.accumulate_final + self.accumulate_earlier + self.backup + self.deferred


def update_bytes(dtype_bytes: int, accumulation_steps: int = 1, clip_mode: str = "",
                 device_sum: bool = False, paired: bool = False, host_norm: bool = True,
                 split: bool = False) -> UpdateBytes:
    """Host bytes per host-updated parameter per step for gradients of ``dtype_bytes`` bytes,
    ``accumulation_steps`` micro-batches and ``clip_mode`` (empty: no clipping; see the module);
    ``device_sum``: the micro-batches are summed on the device (the host sums nothing);
    ``paired``: the host sums them two at a time (``accumulation.paired_units``): the sum is
    read and written once per pair (first pair 4 + 2g, later ones 8 + 2g, an odd last 8 + g);
    without clipping a last pair is left to the update, which reads it and the sum before it (2g,
    or 4 + 2g), and of an odd count the last 16-bit micro-batch, read beside the sum (4 + g),
    instead of the fp32 sum (``LandingZones.fuse_last_pair``);
    ``host_norm``: with clipping, the host reads the gradient for its norm (False: the device
    sums its squares, ``clip_norms.norm_on_device``); ``split``: ``AdamW.split_update``, which
    applies under accumulation to 16-bit compute (see the module)."""
    g, n = dtype_bytes, max(1, int(accumulation_steps))
    grad_read = g if n == 1 else ACC_BYTES  # the pass reads the landed gradient, or the fp32 sum
    kernel = STATE_BYTES + grad_read + (g if g != ACC_BYTES else 0)  # an fp32 master is the working copy
    add = 2 * ACC_BYTES + g
    host_sum = n > 1 and not device_sum
    tail = 0  # the sum landing in the last earlier micro-batch: an odd count's last pair, or the one before the last
    if host_sum and paired and not clip_mode and n > 2 and n % 2 and g != ACC_BYTES:  # the update adds the last one
        final, earlier, kernel = 0, (ACC_BYTES + 2 * g) + (n // 2 - 1) * (add + g), kernel + g  # the pairs before it
        tail = ACC_BYTES + 2 * g if n == 3 else add + g
    elif host_sum and paired:
        pairs, lone = divmod(n, 2)
        total = (ACC_BYTES + 2 * g) + (pairs - 1) * (add + g) + lone * add
        final = add if lone else (ACC_BYTES + 2 * g if pairs == 1 else add + g)
        earlier = total - final
        tail = (ACC_BYTES + 2 * g if pairs == 1 else add + g) if lone and pairs else 0
        if not lone and not clip_mode:  # the update adds the last pair (and the sum before it) as it reads
            kernel += 2 * g - (0 if pairs > 1 else ACC_BYTES)  # no fp32 sum to read when the pair is all
            final = 0
    else:
        final, earlier = (add, (ACC_BYTES + g) + (n - 2) * add) if host_sum else (0, 0)
        tail = (ACC_BYTES + g if n == 2 else add) if host_sum else 0
    deferred = 0
    if split and n > 1 and g != ACC_BYTES:  # the master and moments written later
        kernel, deferred = kernel - STATE_BYTES // 2 + ACC_BYTES, ACC_BYTES + STATE_BYTES
    return UpdateBytes(kernel, final, earlier,
                       BACKUP_BYTES if clip_mode == "speculative" and g == ACC_BYTES else 0,
                       grad_read if clip_mode and host_norm else 0, deferred, tail)


@dataclass(frozen=True)
class HostBudget:
    """Host memory's rate and what the kernel and the copies cost of it (see the module).

    Attributes:
        bandwidth_GBps: B, 10**9 bytes per second.
        kernel_weight: host-memory bytes one byte of the AdamW kernel costs.
        copy_weight: host-memory bytes one host-link byte costs (kappa).
        source: where B and kappa came from, for explanations.
        update_scale, earlier_scale: the rehearsal's calibration of the work once the last
            gradient has landed and of the earlier micro-batches' sums
            (``StepProfile.host_update_scale``, ``host_earlier_scale``).
    """

    bandwidth_GBps: float
    kernel_weight: float
    copy_weight: float
    source: str
    update_scale: float = 1.0
    earlier_scale: float = 1.0

    def seconds(self, nbytes: float, copies_Bps: float = 0.0) -> float:
        """Seconds of ``nbytes`` of host-memory work beside copies moving ``copies_Bps`` bytes/s."""
        bw = self.bandwidth_GBps * 1e9
        return nbytes / max(bw - self.copy_weight * copies_Bps, MIN_SHARE * bw)

    def beside(self, nbytes: float, copy_bytes: float, copy_s: float) -> float:
        """Seconds of ``nbytes`` of host-memory work started beside ``copy_bytes`` of copies that
        take ``copy_s``: at the shared rate while they last, then alone. That is the lesser of
        the shared-rate time and ``(nbytes + kappa x copy_bytes) / B`` (work outlasting the
        copies pays for all of them once)."""
        if nbytes <= 0:
            return 0.0
        if copy_bytes <= 0 or copy_s <= 0:
            return self.seconds(nbytes)
        return min(self.seconds(nbytes, copy_bytes / copy_s), self.seconds(nbytes + self.copy_weight * copy_bytes))

    def work(self, numel: int, ub: UpdateBytes) -> tuple[float, float]:
        """(after the last gradient lands, during earlier micro-batches) host-memory bytes of
        updating ``numel`` parameters, the kernel's bytes weighted, each part calibrated."""
        final = numel * (self.kernel_weight * ub.kernel + ub.final - ub.kernel)
        earlier = numel * (ub.accumulate_earlier + self.kernel_weight * ub.deferred)
        return final * self.update_scale, earlier * self.earlier_scale


def host_budget(profile: "StepProfile", links: "Links") -> HostBudget | None:
    """The budget of ``profile``'s host under ``links``; None for a profile without the byte
    fields (the cost model then keeps its measured in-step rate)."""
    s_a, k = profile.host_adamw_s_per_param, getattr(profile, "host_adamw_bytes_per_param", 0)
    if not k or s_a <= 0:
        return None
    own = k / s_a
    bw = links.host_GBps * 1e9 if links.host_GBps else own
    source = "probe triad" if links.host_GBps else "host kernel alone"
    s_c, d = profile.host_adamw_copies_s_per_param, profile.host_copies_GBps * 1e9
    if s_c > 0 and d > 0:
        kappa, source = bw * max(0.0, 1.0 - s_a / s_c) / d, source + ", copies' cost from the profiled kernel"
    elif links.host_copy_weight is not None:
        kappa, source = links.host_copy_weight, source + ", copies' cost from the probe's triad"
    else:
        kappa, source = 0.0, source + ", copies not measured"
    return HostBudget(bw / 1e9, bw / own, kappa, source, profile.host_update_scale, profile.host_earlier_scale)


def link_bytes(unit: UnitPlan, param_bytes: int, grad_bytes: int, act_bytes: int, kept: bool,
               host: bool) -> tuple[int, int, int]:
    """Host-link bytes of a block run as ``unit``: (forward, backward) per micro-batch and the
    per-step reload of a stale host-homed resident block. A DHA pass reads the weight once
    (cuBLAS's re-reads of a plain kernel over a DHA view are not counted); recomputation in a
    DHA backward reads it again; ``kept``: backward reuses forward's copy. A unit summing on the
    device (``accumulate="device"``) sends no gradient per micro-batch (its fp32 sum goes once a
    step: :func:`unit_terms`)."""
    w = param_bytes
    fwd = w if unit.forward in ("prefetch", "dha") else 0
    if unit.backward == "dha":
        bwd = w * (2 if unit.recompute else 1)
    else:
        bwd = w if unit.backward == "prefetch" and not kept else 0
    bwd += grad_bytes if host and unit.accumulate != "device" else 0
    if unit.offload:
        fwd, bwd = fwd + act_bytes, bwd + act_bytes
    return fwd, bwd, w if unit.forward == "resident" and host else 0


class HostTerms(NamedTuple):
    """One unit's host work per step, in seconds (:func:`unit_terms`).

    Attributes:
        update: its update, in the worker's chain once its last gradient has landed.
        earlier: summing its earlier micro-batches, while they run.
        memory: its host-memory seconds of the step, copies included.
        tail: among ``earlier``, the sum that starts in the last earlier micro-batch
            (``UpdateBytes.accumulate_tail``).
    """

    update: float
    earlier: float
    memory: float
    tail: float = 0.0


def unit_terms(profile: "StepProfile", budget: HostBudget | None, numel: int, host: bool, links: tuple[int, int, int],
               backward_s: float, device_sum: bool = False, paired: bool = False,
               host_norm: bool = True) -> HostTerms:
    """The :class:`HostTerms` of one block; ``links`` from :func:`link_bytes`,
    ``backward_s`` its backward slot. Its update runs beside its own backward's copies
    (:meth:`HostBudget.beside`), a stand-in for those of the blocks whose backward it overlaps;
    each earlier micro-batch's accumulation beside that micro-batch's. ``device_sum``: the
    block sums its micro-batches on the device and its fp32 sum crosses the link once, with
    the last micro-batch's copies; ``paired``: the host sums them two at a time; ``host_norm``:
    with clipping, the host reads its gradient for the norm (:func:`update_bytes`)."""
    if budget is None:
        return HostTerms(numel * profile.host_adamw_s_per_param * profile.host_update_scale if host else 0.0, 0.0, 0.0)
    fwd, bwd, once = links
    n = max(1, profile.accumulation_steps)
    summed = ACC_BYTES * numel if host and device_sum else 0
    link = n * (fwd + bwd) + once + summed
    final = earlier = tail = 0.0
    if host:
        clip = profile.clip_mode if getattr(profile, "clipping", False) else ""
        ub = update_bytes(profile.dtype_bytes, n, clip, device_sum, paired, host_norm,
                          getattr(profile, "split_update", False))
        final, earlier = budget.work(numel, ub)
        tail = numel * ub.accumulate_tail * budget.earlier_scale
    acc = (n - 1) * budget.beside(earlier / (n - 1), bwd, backward_s) if n > 1 else 0.0
    return HostTerms(budget.beside(final, bwd + summed, backward_s), acc,
                     budget.seconds(final + earlier + budget.copy_weight * link), budget.beside(tail, bwd, backward_s))


def rest_terms(profile: "StepProfile", budget: HostBudget | None, rest_host: bool) -> HostTerms:
    """:func:`unit_terms` of ``rest`` (embeddings, head): when host-homed, reloaded once per step
    and its gradients sent home every micro-batch; its update runs after backward, beside no
    copies of its own."""
    if not rest_host:
        return HostTerms(0.0, 0.0, 0.0)
    if budget is None:
        return HostTerms(profile.rest_numel * profile.host_adamw_s_per_param * profile.host_update_scale, 0.0, 0.0)
    links = (0, profile.rest_numel * profile.dtype_bytes, profile.rest_param_bytes)
    one = profile.accumulation_steps <= 1  # the rest unit sums on the host: its norm is the device's only then
    return unit_terms(profile, budget, profile.rest_numel, True, links, 0.0,
                      paired=not profile.data_parallel, host_norm=profile.data_parallel or not one)
