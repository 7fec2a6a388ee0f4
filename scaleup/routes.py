"""Path discovery: which routes reach a device from host memory, how fast, and what they share.

A route to target device ``t`` is either the direct host link (host→t) or a two-hop route
through a peer ``p`` with peer access (host→p over p's own host link, then p→t over the device
interconnect). A route's expected rate is the slower of its hops.

Each hop consumes named *resources*; routes whose hops name the same resource share its
bandwidth. Resource names and capacities (GB/s, one direction) are derived from the
:class:`xpu.Topology`:

* ``link:host->d`` / ``link:p->t``: the link itself, in the direction of travel;
* ``shared:NAME:h2d`` / ``shared:NAME:p2p``: a :attr:`xpu.Link.shared` resource (a PCIe switch
  uplink, a root port), capacity ``topology.extra["shared_GBps"][NAME]`` or else the fastest
  member link;
* ``host-mem``: aggregate host-memory read bandwidth (``topology.host_mem_GBps``), taken by
  every host hop;
* ``port:d:in`` / ``port:d:out``: a device's port into a switched fabric. Links of kinds in
  ``topology.extra["port_kinds"]`` (default ``["nvswitch"]``: a pairwise NVSwitch figure is the
  per-GPU port figure, not a private wire) pass through it; capacity
  ``topology.extra["port_GBps"]`` (a number or ``{device: GBps}``) or else the fastest such
  link at the device;
* ``socket:N->M``: the inter-socket link, when the devices carry ``numa_node`` and
  ``topology.extra["numa_link_GBps"]`` is given; host buffers are assumed on
  ``topology.extra.get("host_numa_node", 0)``.

These ``extra`` keys are this module's conventions until the topology grows them (see the
scaleup report).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from xpu.topology import HOST, Link, Topology

from .links import LinkModel

__all__ = [
    "Hop", "Route", "discover_routes", "resource_capacities", "shared_resources",
    "apply_probe", "max_min_rates", "expected_aggregate_GBps",
]


@dataclass(frozen=True)
class Hop:
    """One hop of a route.

    Attributes:
        src: ``"host"`` or the device index the bytes leave.
        dst: the device index the bytes reach.
        link: the topology link crossed.
        GBps: expected rate (nominal, or measured by ``xpu probe``).
        resources: names of the shared resources this hop consumes (see module docstring).
        model: the :class:`~scaleup.links.LinkModel` that copies over this hop (None: the
            copier uses the backend's own copy).
    """

    src: int | str
    dst: int
    link: Link
    GBps: float
    resources: tuple[str, ...]
    model: LinkModel | None = field(default=None, compare=False)

    @property
    def is_host_hop(self) -> bool:
        """Whether the hop reads host memory."""
        return self.src == HOST


@dataclass(frozen=True)
class Route:
    """A path from host memory to ``target``: one direct hop, or host→peer→target.

    Attributes:
        target: the device the bytes are for.
        hops: the hops in order; the last one lands in ``target``.
    """

    target: int
    hops: tuple[Hop, ...]

    def __post_init__(self) -> None:
        if not self.hops or self.hops[0].src != HOST or self.hops[-1].dst != self.target:
            raise ValueError(f"a route must start at the host and end at device {self.target}: {self.hops}")
        for a, b in zip(self.hops, self.hops[1:]):
            if a.dst != b.src:
                raise ValueError(f"route hops do not chain: {a.src}->{a.dst} then {b.src}->{b.dst}")

    @property
    def via(self) -> int | None:
        """The peer device the route passes through, or None for the direct route."""
        return self.hops[0].dst if len(self.hops) > 1 else None

    @property
    def name(self) -> str:
        """``"host->t"`` or ``"host->p->t"``."""
        return "->".join([HOST] + [str(h.dst) for h in self.hops])

    @property
    def GBps(self) -> float:
        """Expected rate: the slower hop (hops are pipelined chunk by chunk)."""
        return min(h.GBps for h in self.hops)

    @property
    def resources(self) -> frozenset[str]:
        """Every resource any hop of the route consumes."""
        return frozenset(r for h in self.hops for r in h.resources)

    def with_models(self, wrap: Callable[[Hop, LinkModel | None], LinkModel]) -> "Route":
        """A copy whose hop models are ``wrap(hop, current_model)``: the fault-injection point.

        Example: ``route.with_models(lambda hop, m: ThrottledLink(m or BackendLink(b), 1.0))``.
        """
        return replace(self, hops=tuple(replace(h, model=wrap(h, h.model)) for h in self.hops))

    def with_rates(self, rates: Sequence[float]) -> "Route":
        """A copy with each hop's expected rate replaced, in hop order."""
        if len(rates) != len(self.hops):
            raise ValueError(f"route {self.name} has {len(self.hops)} hops, got {len(rates)} rates")
        return replace(self, hops=tuple(replace(h, GBps=float(r)) for h, r in zip(self.hops, rates)))


def _port_kinds(topo: Topology) -> set[str]:
    return set(topo.extra.get("port_kinds", ["nvswitch"]))


def _port_capacity(topo: Topology, device: int) -> float:
    given = topo.extra.get("port_GBps")
    if isinstance(given, (int, float)):
        return float(given)
    if isinstance(given, Mapping) and (device in given or str(device) in given):
        return float(given.get(device, given.get(str(device))))
    kinds = _port_kinds(topo)
    rates = [l.GBps for l in topo.links if l.kind in kinds and device in (l.src, l.dst)]
    return max(rates, default=float("inf"))


def _hop_resources(topo: Topology, link: Link, src: int | str, dst: int) -> tuple[str, ...]:
    res = [f"link:{src}->{dst}"]
    host_hop = src == HOST
    if link.shared:
        res.append(f"shared:{link.shared}:{'h2d' if host_hop else 'p2p'}")
    if host_hop and topo.host_mem_GBps:
        res.append("host-mem")
    if link.kind in _port_kinds(topo):
        if not host_hop:
            res.append(f"port:{src}:out")
        res.append(f"port:{dst}:in")
    numa_rate = topo.extra.get("numa_link_GBps")
    if host_hop and numa_rate:
        home = int(topo.extra.get("host_numa_node", 0))
        node = topo.devices[dst].numa_node
        if node is not None and node != home:
            res.append(f"socket:{home}->{node}")
    return tuple(res)


def resource_capacities(topo: Topology) -> dict[str, float]:
    """GB/s (one direction) of every resource a hop of ``topo`` can name."""
    caps: dict[str, float] = {}
    for link in topo.links:
        ends = [(link.src, link.dst)] if link.src == HOST else [(link.src, link.dst), (link.dst, link.src)]
        for src, dst in ends:
            caps[f"link:{src}->{dst}"] = link.GBps
            if link.shared:
                key = f"shared:{link.shared}:{'h2d' if src == HOST else 'p2p'}"
                given = topo.extra.get("shared_GBps", {}).get(link.shared)
                caps[key] = float(given) if given else max(caps.get(key, 0.0), link.GBps)
    if topo.host_mem_GBps:
        caps["host-mem"] = float(topo.host_mem_GBps)
    for d in range(topo.device_count):
        cap = _port_capacity(topo, d)
        if cap != float("inf"):
            caps[f"port:{d}:in"] = caps[f"port:{d}:out"] = cap
    numa_rate = topo.extra.get("numa_link_GBps")
    if numa_rate:
        home = int(topo.extra.get("host_numa_node", 0))
        for node in {d.numa_node for d in topo.devices if d.numa_node is not None and d.numa_node != home}:
            caps[f"socket:{home}->{node}"] = float(numa_rate)
    return caps


def discover_routes(
    topo: Topology,
    target: int,
    *,
    backend: Any = None,
    model: LinkModel | None = None,
    peers: Iterable[int] | None = None,
    include_direct: bool = True,
) -> list[Route]:
    """Routes from host memory to ``target``: the direct one first, then one per usable peer.

    Args:
        topo: the topology (``backend.topology()`` or a preset).
        target: the device to load.
        backend: when given, a peer is used only if ``backend.can_access_peer(peer, target)``.
        model: the link model every hop gets (None: the copier's default).
        peers: restrict to these peers (None: every peer with a peer link and a host link).
        include_direct: include the target's own host link.

    Raises:
        ValueError: ``target`` is not a device of ``topo``, or a named peer has no route.
    """
    if not (isinstance(target, int) and 0 <= target < topo.device_count):
        raise ValueError(f"target {target!r} is not a device of this topology (0..{topo.device_count - 1})")
    routes: list[Route] = []
    direct = topo.host_link(target)
    if include_direct and direct is not None:
        routes.append(Route(target, (Hop(HOST, target, direct, direct.GBps, _hop_resources(topo, direct, HOST, target), model),)))
    candidates = topo.peers(target) if peers is None else list(peers)
    for p in candidates:
        host, peer = topo.host_link(p), topo.peer_link(p, target)
        if p == target or host is None or peer is None:
            if peers is not None:
                raise ValueError(f"device {p} cannot relay to {target}: it needs its own host link and a peer link to {target}")
            continue
        if backend is not None and not backend.can_access_peer(p, target):
            continue
        hops = (Hop(HOST, p, host, host.GBps, _hop_resources(topo, host, HOST, p), model),
                Hop(p, target, peer, peer.GBps, _hop_resources(topo, peer, p, target), model))
        routes.append(Route(target, hops))
    return routes


def shared_resources(routes: Sequence[Route]) -> dict[str, list[str]]:
    """Resources used by two or more of ``routes``, each with the names of the routes using it."""
    users: dict[str, list[str]] = {}
    for r in routes:
        for res in sorted(r.resources):
            users.setdefault(res, []).append(r.name)
    return {res: names for res, names in users.items() if len(names) > 1}


def apply_probe(routes: Sequence[Route], probe: Mapping[str, Any] | None) -> list[Route]:
    """Routes with expected hop rates replaced by ``xpu probe`` figures where it has them.

    Host hops take ``h2d_pinned_GBps`` (measured on one device; devices of a machine kind are
    alike); peer hops take ``peer_GBps["p->t"]``. Hops the probe did not measure keep their
    nominal rate.
    """
    if not probe:
        return list(routes)
    host_rate = probe.get("h2d_pinned_GBps")
    peer_rates = probe.get("peer_GBps") or {}
    out = []
    for r in routes:
        rates = []
        for h in r.hops:
            measured = host_rate if h.is_host_hop else peer_rates.get(f"{h.src}->{h.dst}")
            rates.append(float(measured) if measured else h.GBps)
        out.append(r.with_rates(rates))
    return out


def max_min_rates(flows: Sequence[Iterable[str]], capacities: Mapping[str, float], limits: Sequence[float] | None = None) -> list[float]:
    """Max-min fair rates of flows over shared resources (progressive filling).

    Args:
        flows: the resource names each flow crosses.
        capacities: capacity per resource; a resource not listed is unlimited.
        limits: an optional own cap per flow.

    Returns:
        One rate per flow, in the unit of ``capacities``. A flow with no finite bound gets
        ``inf``.
    """
    flows = [tuple(r for r in f if r in capacities) for f in flows]
    limits = [float("inf")] * len(flows) if limits is None else [float(x) for x in limits]
    rates = [0.0] * len(flows)
    left = dict(capacities)
    active = set(range(len(flows)))
    while active:
        users: dict[str, list[int]] = {}
        for i in active:
            for r in flows[i]:
                users.setdefault(r, []).append(i)
        step = min([left[r] / len(ix) for r, ix in users.items()] + [limits[i] - rates[i] for i in active])
        if step == float("inf"):
            for i in active:
                rates[i] = float("inf")
            break
        step = max(step, 0.0)
        for i in active:
            rates[i] += step
        for r, ix in users.items():
            left[r] -= step * len(ix)
        eps = 1e-9 * max(1.0, step)
        frozen = {i for i in active if rates[i] >= limits[i] - eps}
        frozen |= {i for r, ix in users.items() if left[r] <= eps for i in ix}
        active -= frozen
    return rates


def expected_aggregate_GBps(routes: Sequence[Route], capacities: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """Predicted steady rate of all ``routes`` used at once, and each route's part, in GB/s.

    Each route is one flow capped at its slower hop, crossing every resource of its hops;
    shared resources are split max-min fairly.
    """
    rates = max_min_rates([r.resources for r in routes], capacities, [r.GBps for r in routes])
    per = {r.name: rate for r, rate in zip(routes, rates)}
    return sum(rates), per
