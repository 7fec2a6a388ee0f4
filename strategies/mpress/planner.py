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

Search: greedy. Stages over budget are served most-over first; each step takes the option
with the least exposed time per byte saved until the stage fits. If a stage cannot fit even
with every block swapped, :class:`InfeasibleBudgetError` states the least budget that would.
:func:`format_plan` writes a plan (and the profiles it came from) as text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xpu.units import format_bytes

from .executor import Decision
from .ipc import RegionAllocator
from .memory_profile import BlockProfile, StageProfile, format_profile

__all__ = ["Plan", "StagePlan", "InfeasibleBudgetError", "plan_offload", "format_plan", "link_rates", "REGION_SLACK"]

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
        regions: ``(writer device, peer device) -> bytes`` of each peer-pool region.
    """

    stages: list[StagePlan]
    regions: dict[tuple[int, int], int] = field(default_factory=dict)

    def decisions(self, stage: int) -> dict[int, Decision]:
        """Block -> decision of ``stage``."""
        return dict(self.stages[stage].decisions)

    def kinds(self) -> set[str]:
        """Decision kinds used anywhere (``keep`` included when a block is kept)."""
        out = {d.kind for s in self.stages for d in s.decisions.values()}
        return out

    @classmethod
    def forced(cls, assignments: dict[int, dict[int, Any]], profiles: list[StageProfile] | None = None,
               region_bytes: int = 0) -> "Plan":
        """A hand-written plan (tests, experiments): ``{stage: {block: "peer:2", ...}}``.

        Peer regions are sized from ``profiles`` when given (as the planner would), else ``region_bytes`` each.
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
                regions[(device, d.peer)] = regions.get((device, d.peer), 0) + need
        return cls(stages, regions)


class InfeasibleBudgetError(ValueError):
    """No plan fits a budget; ``minimum`` maps each failing device to the least budget that would fit."""

    def __init__(self, message: str, minimum: dict[int, int]) -> None:
        super().__init__(message)
        self.minimum = minimum

    def __reduce__(self) -> tuple:
        # Rank 0 broadcasts the refusal to every stage; exceptions with extra arguments need this to unpickle.
        return (type(self), (str(self), self.minimum))


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

    Args:
        profiles: one per stage, from a profiled iteration.
        budgets: device -> bytes it may use (its cap).
        host_rate: device -> host-link bytes/s; peer_rate: (a, b) -> peer-link bytes/s
            (pairs absent cannot swap to each other).
        allow_peer: False where device memory cannot be shared between processes (no ``caps.ipc``).
        overlap: whether copies overlap compute (``caps.async_copy``).
        lookahead: the executor's prefetch look-ahead (sets the transient headroom).
        host_budget: pinned host bytes host swap may use (None: unbounded).

    Raises:
        ValueError: a stage's device has no budget.
        InfeasibleBudgetError: some stage cannot fit; the message states its minimum.
    """
    for p in profiles:
        if p.device not in budgets:
            raise ValueError(f"no budget for device {p.device} (stage {p.stage}); budgets given: {sorted(budgets)}")
        if budgets[p.device] <= 0:
            raise ValueError(f"budget for device {p.device} must be positive, got {budgets[p.device]}")
    plans = [StagePlan(p.stage, p.device, budgets[p.device], peak_before=p.peak_bytes, peak_estimated=p.mode != "keep")
             for p in profiles]
    by_device = {p.device: i for i, p in enumerate(profiles)}
    saved: list[int] = [0] * len(profiles)
    hosted = {p.device: 0 for p in profiles}
    host_used = 0

    def transient(i: int) -> int:
        nonkeep = [b.saved_bytes for b in profiles[i].blocks if plans[i].decisions.get(b.index, Decision("keep")).kind != "keep"]
        return (1 + lookahead) * max(nonkeep, default=0)

    def predicted(i: int) -> int:
        return profiles[i].peak_bytes - saved[i] + transient(i) + hosted[profiles[i].device]

    # Minimum each stage could reach alone (every block swapped or recomputed, whichever saves more).
    def minimum(i: int) -> int:
        p = profiles[i]
        best = 0
        for b in p.blocks:
            swap = p.inflight * b.saved_bytes if (allow_host or allow_peer) else 0
            rec = p.inflight * max(0, b.saved_bytes - b.input_bytes) if allow_recompute else 0
            best += max(swap, rec)
        return p.peak_bytes - best + (1 + lookahead) * max((b.saved_bytes for b in p.blocks), default=0)

    order = sorted(range(len(profiles)), key=lambda i: predicted(i) - budgets[profiles[i].device], reverse=True)
    over = {i for i in order if predicted(i) > budgets[profiles[i].device]}
    failing: dict[int, int] = {}
    for i in order:
        if i not in over:
            continue
        p = profiles[i]
        blocks = list(p.blocks)
        k, m = p.inflight, p.microbatches
        while predicted(i) > budgets[p.device]:
            best: tuple | None = None  # (exposed per byte, busy per byte, -save, pos, decision, region)
            for pos, bp in enumerate(blocks):
                if bp.index in plans[i].decisions:
                    continue
                later = blocks[pos + 1:]
                # (decision, bytes saved, exposed seconds, region bytes, busy seconds): when exposed
                # times tie (both hidden), the option that keeps its resource busy less wins, so
                # a fast peer link is preferred over the host link that other traffic shares.
                options: list[tuple[Decision, int, float, int, float]] = []
                if allow_recompute and bp.saved_bytes > bp.input_bytes:
                    options.append((Decision("recompute"), k * (bp.saved_bytes - bp.input_bytes), m * bp.fwd_s, 0,
                                    m * bp.fwd_s))
                hr = host_rate.get(p.device, 0.0)
                if allow_host and hr > 0 and (host_budget is None or host_used + k * bp.saved_bytes <= host_budget):
                    options.append((Decision("host"), k * bp.saved_bytes, m * _exposed(bp, later, hr, overlap), 0,
                                    2 * m * bp.saved_bytes / hr))
                if allow_peer:
                    for j in sorted(by_device):
                        rate = peer_rate.get((p.device, j), 0.0)
                        if j == p.device or rate <= 0 or by_device[j] in over:
                            continue
                        need = _region_need(bp, k)
                        if predicted(by_device[j]) + need > budgets[j]:
                            continue
                        options.append((Decision("peer", j), k * bp.saved_bytes, m * _exposed(bp, later, rate, overlap), need,
                                        2 * m * bp.saved_bytes / rate))
                for dec, save, cost, region, busy in options:
                    if save <= 0 or cost == float("inf"):
                        continue
                    key = (cost / save, busy / save, -save, pos, dec, region)
                    if best is None or key[:4] < best[:4]:
                        best = key
            if best is None:
                failing[p.device] = minimum(i)
                break
            _, _, neg_save, pos, dec, region = best
            bp = blocks[pos]
            sp = plans[i]
            sp.decisions[bp.index] = dec
            saved[i] += -neg_save
            later = blocks[pos + 1:]
            if dec.kind == "recompute":
                sp.recomputed += -neg_save
                sp.exposed_s += m * bp.fwd_s
            elif dec.kind == "host":
                sp.to_host += -neg_save
                host_used += -neg_save
                sp.exposed_s += m * _exposed(bp, later, host_rate.get(p.device, 0.0), overlap)
            else:
                sp.to_peer[dec.peer] = sp.to_peer.get(dec.peer, 0) + -neg_save
                hosted[dec.peer] += region
                plans[by_device[dec.peer]].hosted += region
                sp.exposed_s += m * _exposed(bp, later, peer_rate[(p.device, dec.peer)], overlap)
    if failing:
        lines = [f"device {d} (stage {by_device[d]}): budget {format_bytes(budgets[d])}, needs at least {format_bytes(need)}"
                 for d, need in sorted(failing.items())]
        raise InfeasibleBudgetError("infeasible memory budget; " + "; ".join(lines), failing)
    regions: dict[tuple[int, int], int] = {}
    for i, p in enumerate(profiles):
        sp = plans[i]
        for bp in p.blocks:
            d = sp.decisions.get(bp.index)
            if d is None:
                sp.kept += p.inflight * bp.saved_bytes
            elif d.kind == "peer":
                regions[(p.device, d.peer)] = regions.get((p.device, d.peer), 0) + _region_need(bp, p.inflight)
        sp.predicted_peak = predicted(i)
    return Plan(plans, regions)


def format_plan(plan: Plan, profiles: "list[StageProfile | None] | None" = None) -> str:
    """The plan as text: per stage, bytes kept / recomputed / to each peer / to host, predicted peak,
    spare memory under the budget and exposed time; with ``profiles``, each stage's
    :func:`format_profile` line too (also for stages the plan does not list)."""
    lines = []
    by_stage = {p.stage: p for p in profiles or () if p is not None}
    listed = set()
    for sp in plan.stages:
        listed.add(sp.stage)
        peers = ", ".join(f"peer {j}: {format_bytes(b)}" for j, b in sorted(sp.to_peer.items())) or "peers: 0 B"
        peak = format_bytes(sp.peak_before)
        if sp.peak_estimated:
            peak = f"~{peak} (all-keep estimate: profiled with host swap)"
        spare = ""
        if sp.budget > 0:  # forced plans have no budget to be spare under
            left = sp.budget - sp.predicted_peak
            spare = f" (spare {format_bytes(left) if left >= 0 else '-' + format_bytes(-left)})"
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
