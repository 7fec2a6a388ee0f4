"""A discrete-event model of multi-path transfers, driven by the copier's own policy.

Routes and their hops come from :func:`~scaleup.routes.discover_routes`; each hop consumes
named resources (links, a switch port, host-memory bandwidth) with capacities from
:func:`~scaleup.routes.resource_capacities`. Every running hop is a flow; flows sharing a
resource split it max-min fairly, and rates are recomputed whenever a flow starts or ends
or the model changes. Per route the hops behave like the copier's streams: one chunk per hop
at a time, chunk k+1's first hop overlapping chunk k's second, at most ``window`` chunks in
flight (which bounds peer staging slots too). Chunks are handed out by the same
:class:`~scaleup.policy.SplitPolicy`, fed the same measurement (a chunk's slowest hop time).

Scripted :class:`Change` and :class:`Fail` events model a link that slows down or dies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .policy import Observation, SplitPolicy
from .routes import Route, max_min_rates

__all__ = ["PathSimulator", "SimResult", "Change", "Fail"]


@dataclass(frozen=True)
class Change:
    """At ``at_s`` seconds, set ``resource``'s capacity to ``GBps``."""

    at_s: float
    resource: str
    GBps: float


@dataclass(frozen=True)
class Fail:
    """At ``at_s`` seconds, route ``route`` fails: its chunks in flight are lost and re-sent."""

    at_s: float
    route: str


@dataclass
class SimResult:
    """What a simulated transfer did.

    Attributes:
        nbytes: bytes moved.
        seconds: simulated time until the last byte arrived.
        GBps: ``nbytes / seconds`` in GB/s.
        bytes_per_route: bytes each route delivered.
        chunks_per_route: chunks each route delivered.
        history: ``(time_s, observation)`` per finished chunk, in order.
        dropped: failed routes and why.
    """

    nbytes: int
    seconds: float
    GBps: float
    bytes_per_route: dict[str, int]
    chunks_per_route: dict[str, int]
    history: list[tuple[float, Observation]] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)


@dataclass
class _Flow:
    route: str
    chunk: int
    hop: int
    left: float
    resources: tuple[str, ...]
    start: float


class PathSimulator:
    """Simulate transfers over ``routes`` with resource ``capacities`` (GB/s).

    Args:
        routes: routes to one target (hops name their resources).
        capacities: GB/s of every resource the hops name (the modelled truth).
        chunk_bytes: chunk size.
        window: chunks in flight per route (and so peer staging slots).
        smoothing: the policy's smoothing weight.
        prior_GBps: the policy's initial estimates by route name (default: ``route.GBps``,
            i.e. what probe/topology say, which may differ from ``capacities``).

    Raises:
        ValueError: a hop with no finite-capacity resource, or bad sizes.
    """

    def __init__(self, routes: Sequence[Route], capacities: Mapping[str, float], *, chunk_bytes: int = 16 * 2**20,
                 window: int = 2, smoothing: float = 0.5, prior_GBps: Mapping[str, float] | None = None) -> None:
        if chunk_bytes <= 0 or window < 1:
            raise ValueError(f"need chunk_bytes > 0 and window >= 1, got {chunk_bytes} and {window}")
        if not routes:
            raise ValueError("PathSimulator needs at least one route")
        for r in routes:
            for h in r.hops:
                if not any(res in capacities for res in h.resources):
                    raise ValueError(f"hop {h.src}->{h.dst} of {r.name} names no resource with a capacity: {h.resources}")
        self.routes = {r.name: r for r in routes}
        self.capacities = dict(capacities)
        self.chunk_bytes, self.window, self.smoothing = chunk_bytes, window, smoothing
        self.prior = dict(prior_GBps) if prior_GBps else {r.name: r.GBps for r in routes}

    def run(self, nbytes: int, events: Sequence[Change | Fail] = (), policy: SplitPolicy | None = None) -> SimResult:
        """Simulate one host→target transfer of ``nbytes``.

        Args:
            nbytes: transfer size.
            events: scripted changes and failures, at simulated times.
            policy: a policy to continue with (default: a fresh one from the priors).

        Raises:
            RuntimeError: every route failed before the data arrived.
        """
        policy = policy or SplitPolicy(self.prior, smoothing=self.smoothing)
        caps = dict(self.capacities)
        sizes = [min(self.chunk_bytes, nbytes - off) for off in range(0, nbytes, self.chunk_bytes)]
        pending: deque[int] = deque(range(len(sizes)))
        remaining = nbytes
        names = list(self.routes)
        queues = {n: [deque() for _ in self.routes[n].hops] for n in names}
        busy: dict[tuple[str, int], _Flow | None] = {(n, i): None for n in names for i in range(len(self.routes[n].hops))}
        inflight: dict[str, set[int]] = {n: set() for n in names}
        durations: dict[int, list[float]] = {}
        result = SimResult(nbytes, 0.0, 0.0, {n: 0 for n in names}, {n: 0 for n in names})
        script = sorted(events, key=lambda e: e.at_s)
        t, done = 0.0, 0

        while done < len(sizes):
            live = policy.live
            if not live:
                raise RuntimeError(f"every route failed at t={t:.4f} s: {policy.dropped}")
            while pending:
                free = [n for n in live if len(inflight[n]) < self.window]
                backlog = {n: sum(sizes[c] for c in inflight[n]) for n in live}
                name = policy.pick(free, backlog, remaining, sizes[pending[0]])
                if name is None:
                    break
                c = pending.popleft()
                remaining -= sizes[c]
                inflight[name].add(c)
                durations[c] = []
                queues[name][0].append(c)
            for n in live:
                for i, hop in enumerate(self.routes[n].hops):
                    if busy[(n, i)] is None and queues[n][i]:
                        c = queues[n][i].popleft()
                        busy[(n, i)] = _Flow(n, c, i, float(sizes[c]), hop.resources, t)
            flows = [f for f in busy.values() if f is not None]
            rates = [r * 1e9 for r in max_min_rates([f.resources for f in flows], caps)] if flows else []
            dt = min((f.left / r for f, r in zip(flows, rates) if r > 0), default=float("inf"))
            if script and script[0].at_s - t < dt:
                dt = max(script[0].at_s - t, 0.0)
            if dt == float("inf"):
                raise RuntimeError(f"simulation stuck at t={t:.4f} s: no flow can move (capacities {caps})")
            t += dt
            for f, r in zip(flows, rates):
                f.left -= r * dt
            for f in flows:
                if f.left > 1e-6 * self.chunk_bytes:
                    continue
                busy[(f.route, f.hop)] = None
                durations[f.chunk].append(t - f.start)
                if f.hop + 1 < len(self.routes[f.route].hops):
                    queues[f.route][f.hop + 1].append(f.chunk)
                    continue
                inflight[f.route].discard(f.chunk)
                done += 1
                result.bytes_per_route[f.route] += sizes[f.chunk]
                result.chunks_per_route[f.route] += 1
                obs = policy.observe(f.route, sizes[f.chunk], max(durations[f.chunk]))
                result.history.append((t, obs))
            while script and script[0].at_s <= t:
                event = script.pop(0)
                if isinstance(event, Change):
                    caps[event.resource] = event.GBps
                else:
                    self._fail(event.route, policy, queues, busy, inflight, pending, sizes)
                    remaining = sum(sizes[c] for c in pending)
                    result.dropped[event.route] = f"failed at {t:.4f} s"
        result.seconds = t
        result.GBps = nbytes / t / 1e9 if t > 0 else 0.0
        return result

    def _fail(self, name: str, policy: SplitPolicy, queues, busy, inflight, pending: deque, sizes) -> None:
        policy.drop(name, "failed (simulated)")
        lost = sorted(inflight[name], reverse=True)
        for c in lost:
            pending.appendleft(c)  # re-sent on the other routes, first
        inflight[name].clear()
        for q in queues[name]:
            q.clear()
        for key in list(busy):
            if key[0] == name:
                busy[key] = None
