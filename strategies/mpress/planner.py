"""The MPress planner: per block, keep / recompute / swap to a peer device / swap to host.

Inputs come from one profiled iteration (:class:`~strategies.mpress.memory_profile.StageProfile`,
one per stage: per block its saved-activation and input bytes, forward, backward and gap
times; per stage the micro-batches in flight and the all-keep peak). Link rates come from the
``xpu probe`` cache when there is one, else the topology's nominal rates.

Model (per micro-batch, per block ``b`` of a stage with ``k`` micro-batches in flight):

* recompute saves ``k * (saved - input)`` bytes and costs the block's forward time;
* a swap over a link of rate ``R`` saves ``k * saved`` bytes; its copy ``t = saved / R``
  hides under the stage's later forward work (swap-out) and under the next block's backward
  (prefetch, one block of look-ahead); what does not fit, or does not fit in the gap between
  the block's forward and backward, is exposed. Without ``caps.async_copy`` nothing hides.
* a peer swap also takes ``k * saved`` (plus alignment) of the peer's spare memory;
* every non-kept block re-materialises its tensors in backward: the planner reserves
  ``(1 + lookahead) * max saved`` of transient headroom.

Budgets are per device. Stages that share a device (``PipelineJob.devices``) share its budget:
the sum of their predicted peaks, plus the peer pools hosted there, must fit it; and they
never swap to each other, since a pool on their own device is the same memory (no relief,
only a copy).

Search: greedy. Devices over budget are served most-over first; each step takes the option,
among the blocks of every stage on the device, with the least exposed time per byte saved
until the device fits. If a device cannot fit even with every block of its stages swapped,
:class:`InfeasibleBudgetError` states the least budget that would.
:func:`format_plan` writes a plan (and the profiles it came from) as text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpu.units import format_bytes

from .executor import Decision
from .ipc import RegionAllocator
from .memory_profile import BlockProfile, StageProfile, format_profile

__all__ = ["Plan", "StagePlan", "InfeasibleBudgetError", "PlanOverBudgetError", "plan_offload", "infeasible",
           "stages_text", "format_plan", "link_rates", "REGION_SLACK"]

#: Extra fraction of each peer region, for fragmentation of its first-fit allocator.
REGION_SLACK = 0.125


@dataclass
class StagePlan:
    """The plan of one stage and what it predicts."""

    stage: int
    device: int
    budget: int
    decisions: dict[int, Decision] = field(default_factory=dict)
    kept: int = 0
    recomputed: int = 0
    to_host: int = 0
    to_peer: dict[int, int] = field(default_factory=dict)
    hosted: int = 0
    exposed_s: float = 0.0
    peak_before: int = 0
    predicted_peak: int = 0
    #: ``peak_before`` is an estimate (the stage was profiled with every block host-swapped).
    peak_estimated: bool = False


@dataclass
class Plan:
    """Decisions for every stage, peer region sizes, and predictions.

    Attributes:
        stages: one :class:`StagePlan` per stage, by stage index.
        regions: ``(writer stage, peer stage) -> bytes`` of each peer-pool region (the peer hosts it).
    """

    stages: list[StagePlan]
    regions: dict[tuple[int, int], int] = field(default_factory=dict)

    def decisions(self, stage: int) -> dict[int, Decision]:
        """Block -> decision of ``stage``."""
        return dict(self.stages[stage].decisions)

    def device_peaks(self) -> dict[int, int]:
        """Device -> the predicted peak of its stages together (what its budget must hold)."""
        out: dict[int, int] = {}
        for sp in self.stages:
            out[sp.device] = out.get(sp.device, 0) + sp.predicted_peak
        return out

    def kinds(self) -> set[str]:
        """Decision kinds used anywhere (``keep`` included when a block is kept)."""
        out = {d.kind for s in self.stages for d in s.decisions.values()}
        return out

    @classmethod
    def forced(cls, assignments: dict[int, dict[int, Any]], profiles: list[StageProfile] | None = None,
               region_bytes: int = 0) -> "Plan":
        """A hand-written plan (tests, experiments): ``{stage: {block: "peer:2", ...}}``.

        Peer regions are sized from ``profiles`` when given (as the planner would), else ``region_bytes`` each;
        they are keyed by stage, as the planner's.
        """
        stages, regions = [], {}
        n = max(assignments) + 1 if assignments else 0
        if profiles is not None:
            n = max(n, len(profiles))
        for s in range(n):
            decs = {int(b): Decision.parse(d) for b, d in assignments.get(s, {}).items()}
            device = profiles[s].device if profiles else s
            stages.append(StagePlan(s, device, 0, decs))
            for b, d in decs.items():
                if d.kind != "peer":
                    continue
                if profiles is not None:
                    bp = next(x for x in profiles[s].blocks if x.index == b)
                    need = _region_need(bp, profiles[s].inflight)
                else:
                    need = region_bytes
                regions[(s, d.peer)] = regions.get((s, d.peer), 0) + need
        return cls(stages, regions)


class InfeasibleBudgetError(ValueError):
    """No plan fits a budget; ``minimum`` maps each failing device to the least budget that would fit
    (for stages sharing a device: the budget of the device, which they share)."""

    def __init__(self, message: str, minimum: dict[int, int]) -> None:
        super().__init__(message)
        self.minimum = minimum

    def __reduce__(self) -> tuple:
        # Rank 0 broadcasts the refusal to every stage; exceptions with extra arguments need this to unpickle.
        return (type(self), (str(self), self.minimum))


class PlanOverBudgetError(InfeasibleBudgetError):
    """A plan the job gives (``keep``, or ``{stage: {block: decision}}``) does not fit a device's budget
    (one uncapped step measured it); ``minimum`` maps each such device to the peak it measured."""


def link_rates(backend: Any) -> tuple[dict[int, float], dict[tuple[int, int], float]]:
    """Bytes/s of each device's host link and of each peer pair: measured (probe cache) over nominal."""
    topo = backend.topology()
    n = topo.device_count
    host = {}
    for d in range(n):
        link = topo.host_link(d)
        host[d] = link.GBps * 1e9 if link else 0.0
    peer = {}
    for a in range(n):
        for b in range(n):
            link = topo.peer_link(a, b) if a != b else None
            if link is not None:
                peer[(a, b)] = link.GBps * 1e9
    try:
        from xpu.probe import load_cached

        measured = load_cached(backend) or {}
    except Exception:  # a broken cache must not stop planning: nominal rates still hold
        measured = {}
    if measured.get("d2h_pinned_GBps") and measured.get("h2d_pinned_GBps"):
        rate = min(measured["d2h_pinned_GBps"], measured["h2d_pinned_GBps"]) * 1e9
        host = {d: rate for d in host}
    for key, gbps in (measured.get("peer_GBps") or {}).items():
        a, _, b = key.partition("->")
        if a.isdigit() and b.isdigit() and (int(a), int(b)) in peer:
            peer[(int(a), int(b))] = float(gbps) * 1e9
    return host, peer


def _region_need(bp: BlockProfile, inflight: int) -> int:
    per_tensor = bp.saved_bytes / max(1, bp.tensors)
    per_mb = bp.tensors * RegionAllocator.footprint(int(per_tensor) + 1)
    return int(inflight * per_mb * (1 + REGION_SLACK)) + 4096


def _exposed(bp: BlockProfile, later: list[BlockProfile], rate: float, overlap: bool) -> float:
    """Exposed seconds of one swap-out plus prefetch of ``bp`` over a link of ``rate`` bytes/s."""
    if rate <= 0:
        return float("inf")
    t = bp.saved_bytes / rate
    if not overlap:
        return 2 * t
    fwd_after = sum(b.fwd_s for b in later)
    bwd_window = later[0].bwd_s if later else 0.0
    hidden_split = max(0.0, t - fwd_after) + max(0.0, t - bwd_window)
    return max(hidden_split, 2 * t - bp.gap_s)


def plan_offload(profiles: list[StageProfile], budgets: dict[int, int], *, host_rate: dict[int, float],
                 peer_rate: dict[tuple[int, int], float], allow_peer: bool = True, allow_host: bool = True,
                 allow_recompute: bool = True, overlap: bool = True, lookahead: int = 1,
                 host_budget: int | None = None) -> Plan:
    """Choose a decision per block so every device's predicted peak fits its budget.

    Stages are named by ``profile.stage`` (``peer:<j>`` names stage ``j``) and placed by
    ``profile.device``: the stages of one device share its budget, and never swap to each other.

    Args:
        profiles: one per stage, by stage index, from a profiled iteration.
        budgets: device -> bytes its stages may use together (its cap).
        host_rate: device -> host-link bytes/s; peer_rate: (device a, device b) -> peer-link bytes/s
            (pairs absent cannot swap to each other).
        allow_peer: False where device memory cannot be shared between processes (no ``caps.ipc``).
        overlap: whether copies overlap compute (``caps.async_copy``).
        lookahead: the executor's prefetch look-ahead (sets the transient headroom).
        host_budget: pinned host bytes host swap may use (None: unbounded).

    Raises:
        ValueError: a stage's device has no budget.
        InfeasibleBudgetError: some device cannot fit its stages; the message states its minimum.
    """
    for p in profiles:
        if p.device not in budgets:
            raise ValueError(f"no budget for device {p.device} (stage {p.stage}); budgets given: {sorted(budgets)}")
        if budgets[p.device] <= 0:
            raise ValueError(f"budget for device {p.device} must be positive, got {budgets[p.device]}")
    plans = [StagePlan(p.stage, p.device, budgets[p.device], peak_before=p.peak_bytes, peak_estimated=p.mode != "keep")
             for p in profiles]
    on: dict[int, list[int]] = {}  # device -> positions of its stages
    for i, p in enumerate(profiles):
        on.setdefault(p.device, []).append(i)
    position = {p.stage: i for i, p in enumerate(profiles)}
    saved: list[int] = [0] * len(profiles)
    host_used = 0

    def transient(i: int) -> int:
        nonkeep = [b.saved_bytes for b in profiles[i].blocks if plans[i].decisions.get(b.index, Decision("keep")).kind != "keep"]
        return (1 + lookahead) * max(nonkeep, default=0)

    def predicted(i: int) -> int:
        return profiles[i].peak_bytes - saved[i] + transient(i) + plans[i].hosted

    def load(d: int) -> int:
        return sum(predicted(i) for i in on[d])

    # Minimum each stage could reach alone (every block swapped or recomputed, whichever saves more).
    def minimum(i: int) -> int:
        p = profiles[i]
        best = 0
        for b in p.blocks:
            swap = p.inflight * b.saved_bytes if (allow_host or allow_peer) else 0
            rec = p.inflight * max(0, b.saved_bytes - b.input_bytes) if allow_recompute else 0
            best += max(swap, rec)
        return p.peak_bytes - best + (1 + lookahead) * max((b.saved_bytes for b in p.blocks), default=0)

    order = sorted(on, key=lambda d: load(d) - budgets[d], reverse=True)
    over = {d for d in order if load(d) > budgets[d]}
    failing: dict[int, int] = {}
    for d in order:
        if d not in over:
            continue
        while load(d) > budgets[d]:
            best: tuple | None = None  # (exposed per byte, busy per byte, -save, i, pos, decision, region)
            for i in on[d]:
                p = profiles[i]
                k, m = p.inflight, p.microbatches
                for pos, bp in enumerate(p.blocks):
                    if bp.index in plans[i].decisions:
                        continue
                    later = list(p.blocks[pos + 1:])
                    # (decision, bytes saved, exposed seconds, region bytes, busy seconds): when exposed
                    # times tie (both hidden), the option that keeps its resource busy less wins, so
                    # a fast peer link is preferred over the host link that other traffic shares.
                    options: list[tuple[Decision, int, float, int, float]] = []
                    if allow_recompute and bp.saved_bytes > bp.input_bytes:
                        options.append((Decision("recompute"), k * (bp.saved_bytes - bp.input_bytes), m * bp.fwd_s, 0,
                                        m * bp.fwd_s))
                    hr = host_rate.get(d, 0.0)
                    if allow_host and hr > 0 and (host_budget is None or host_used + k * bp.saved_bytes <= host_budget):
                        options.append((Decision("host"), k * bp.saved_bytes, m * _exposed(bp, later, hr, overlap), 0,
                                        2 * m * bp.saved_bytes / hr))
                    for q in profiles if allow_peer else []:
                        rate = peer_rate.get((d, q.device), 0.0)
                        # A stage on this same device is no destination: its pool is this memory.
                        if q.device == d or rate <= 0 or q.device in over:
                            continue
                        need = _region_need(bp, k)
                        if load(q.device) + need > budgets[q.device]:
                            continue
                        options.append((Decision("peer", q.stage), k * bp.saved_bytes,
                                        m * _exposed(bp, later, rate, overlap), need, 2 * m * bp.saved_bytes / rate))
                    for dec, save, cost, region, busy in options:
                        if save <= 0 or cost == float("inf"):
                            continue
                        key = (cost / save, busy / save, -save, i, pos, dec, region)
                        if best is None or key[:5] < best[:5]:
                            best = key
            if best is None:
                failing[d] = sum(minimum(i) for i in on[d])
                break
            _, _, neg_save, i, pos, dec, region = best
            p = profiles[i]
            bp = p.blocks[pos]
            sp = plans[i]
            sp.decisions[bp.index] = dec
            saved[i] += -neg_save
            later = list(p.blocks[pos + 1:])
            if dec.kind == "recompute":
                sp.recomputed += -neg_save
                sp.exposed_s += p.microbatches * bp.fwd_s
            elif dec.kind == "host":
                sp.to_host += -neg_save
                host_used += -neg_save
                sp.exposed_s += p.microbatches * _exposed(bp, later, host_rate.get(d, 0.0), overlap)
            else:
                peer = profiles[position[dec.peer]]
                sp.to_peer[dec.peer] = sp.to_peer.get(dec.peer, 0) + -neg_save
                plans[position[dec.peer]].hosted += region
                sp.exposed_s += p.microbatches * _exposed(bp, later, peer_rate[(d, peer.device)], overlap)
    if failing:
        raise infeasible(failing, budgets, {d: [profiles[i].stage for i in on[d]] for d in on})
    regions: dict[tuple[int, int], int] = {}
    for i, p in enumerate(profiles):
        sp = plans[i]
        for bp in p.blocks:
            dec = sp.decisions.get(bp.index)
            if dec is None:
                sp.kept += p.inflight * bp.saved_bytes
            elif dec.kind == "peer":
                regions[(p.stage, dec.peer)] = regions.get((p.stage, dec.peer), 0) + _region_need(bp, p.inflight)
        sp.predicted_peak = predicted(i)
    return Plan(plans, regions)


def infeasible(minimum: dict[int, int], budgets: dict[int, int], stages_on: dict[int, list[int]],
               note: str = "") -> InfeasibleBudgetError:
    """The refusal for devices that no plan fits: each with its stages, its budget and ``minimum[device]``."""
    lines = [f"device {d} ({stages_text(stages_on[d])}): budget {format_bytes(budgets[d])}, "
             f"needs at least {format_bytes(need)}" for d, need in sorted(minimum.items())]
    return InfeasibleBudgetError("infeasible memory budget; " + "; ".join(lines) + note, minimum)


def stages_text(stages: list[int]) -> str:
    """``stage 0`` or ``stages 0, 1``."""
    return f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(map(str, stages))


def format_plan(plan: Plan, profiles: "list[StageProfile | None] | None" = None) -> str:
    """The plan as text: per stage, bytes kept / recomputed / to each peer / to host, predicted peak,
    spare memory under the budget and exposed time (for stages sharing a device, a line per such
    device gives their predicted peak together and its spare instead); with ``profiles``, each stage's
    :func:`format_profile` line too (also for stages the plan does not list)."""
    lines = []
    by_stage = {p.stage: p for p in profiles or () if p is not None}
    listed = set()
    together = plan.device_peaks()
    sharing = {sp.device for sp in plan.stages if sum(q.device == sp.device for q in plan.stages) > 1}
    for device in sorted(sharing):
        on = [sp for sp in plan.stages if sp.device == device]
        budget = on[0].budget
        text = f"device {device} ({stages_text([sp.stage for sp in on])}, one budget): predicted "
        text += format_bytes(together[device])
        lines.append(text + (f" of {format_bytes(budget)}{_spare(budget - together[device])}" if budget > 0 else ""))
    for sp in plan.stages:
        listed.add(sp.stage)
        peers = ", ".join(f"peer {j}: {format_bytes(b)}" for j, b in sorted(sp.to_peer.items())) or "peers: 0 B"
        peak = format_bytes(sp.peak_before)
        if sp.peak_estimated:
            peak = f"~{peak} (all-keep estimate: profiled with host swap)"
        spare = ""
        if sp.budget > 0 and sp.device not in sharing:  # forced plans have no budget to be spare under
            spare = _spare(sp.budget - sp.predicted_peak)
        lines.append(
            f"stage {sp.stage} (device {sp.device}): budget {format_bytes(sp.budget)}, peak {peak}"
            f" -> predicted {format_bytes(sp.predicted_peak)}{spare}; kept {format_bytes(sp.kept)}, recomputed "
            f"{format_bytes(sp.recomputed)}, {peers}, host {format_bytes(sp.to_host)}, hosts peer pools "
            f"{format_bytes(sp.hosted)}; predicted exposed {sp.exposed_s * 1e3:.3f} ms/iteration")
        if sp.decisions:
            lines.append("    " + ", ".join(f"block {b}: {d}" for b, d in sorted(sp.decisions.items())))
        if sp.stage in by_stage:
            lines.append("    profile: " + format_profile(by_stage[sp.stage]))
    for stage in sorted(set(by_stage) - listed):
        lines.append("profile: " + format_profile(by_stage[stage]))
    return "\n".join(lines)


def _spare(left: int) -> str:
    """`` (spare 1.0 MB)``, or a negative spare over the budget."""
    return f" (spare {format_bytes(left) if left >= 0 else '-' + format_bytes(-left)})"
