"""Devices and the links between them and the host, as one frozen, JSON-serialisable value.

Backends build a ``Topology`` from what the hardware reports (NVML, ``npu-smi``) or from
declared numbers (the cpu backend); planners and the scaleup copier read it; tests inject
layouts (a DGX node, a CloudMatrix node) through :func:`preset` or :meth:`Topology.from_dict`.

A :class:`Link` is full duplex: ``GBps`` is the nominal rate *in each direction*. Host
links connect the endpoint ``"host"`` to a device index; peer links connect two device
indices. Nominal rates are leads, not facts: ``xpu probe`` measures the real ones.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Union

__all__ = ["HOST", "Link", "DeviceSpec", "Topology", "preset", "PRESETS"]

#: The endpoint name for host memory in a :class:`Link`.
HOST = "host"

Endpoint = Union[int, str]


@dataclass(frozen=True)
class Link:
    """One full-duplex link.

    Attributes:
        src: ``"host"`` or a device index.
        dst: a device index.
        kind: ``"pcie"``, ``"nvlink"``, ``"nvswitch"``, ``"hccs"``, ``"sio"``, ``"ub"``,
            ``"virtual"`` (the cpu backend), ...
        GBps: nominal bandwidth per direction, in GB/s (10**9 bytes per second).
        detail: what the rate was derived from, e.g. ``"PCIe Gen5 x16"``.
        shared: name of a resource this link shares with others (a PCIe switch, a host
            memory controller), or ``None``; links with the same name share its bandwidth.
    """

    src: Endpoint
    dst: Endpoint
    kind: str
    GBps: float
    detail: str = ""
    shared: str | None = None

    def connects(self, a: Endpoint, b: Endpoint) -> bool:
        """Whether this link joins ``a`` and ``b`` (in either order)."""
        return {self.src, self.dst} == {a, b}

    @property
    def is_host_link(self) -> bool:
        """Whether one end is host memory."""
        return HOST in (self.src, self.dst)


@dataclass(frozen=True)
class DeviceSpec:
    """One device as the topology sees it.

    Attributes:
        index: the logical index torch uses (after ``*_VISIBLE_DEVICES`` remapping).
        name: the product name, e.g. ``"NVIDIA H200"``.
        total_bytes: device memory, before any cap.
        numa_node: the host NUMA node closest to the device, when known.
        uuid: a stable identifier (NVML UUID, NPU chip id), when known.
    """

    index: int
    name: str
    total_bytes: int
    numa_node: int | None = None
    uuid: str | None = None


@dataclass(frozen=True)
class Topology:
    """Devices plus host and peer links; frozen so it can be cached and compared.

    Attributes:
        devices: one :class:`DeviceSpec` per logical device, by index.
        links: host links and peer links (each pair at most once).
        host_mem_GBps: aggregate host-memory bandwidth, when known (bounds many host links
            used at once).
        source: where the figures came from (``"nvml"``, ``"npu-smi"``, ``"declared"``,
            ``"preset:dgx-h100"``...).
    """

    devices: tuple[DeviceSpec, ...]
    links: tuple[Link, ...]
    host_mem_GBps: float | None = None
    source: str = "declared"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        indices = [d.index for d in self.devices]
        if indices != list(range(len(indices))):
            raise ValueError(f"device indices must be 0..n-1 in order, got {indices}")
        for link in self.links:
            for end in (link.src, link.dst):
                if end != HOST and not (isinstance(end, int) and 0 <= end < len(indices)):
                    raise ValueError(f"link {link} names endpoint {end!r}, which is neither 'host' nor a device index")
            if link.GBps <= 0:
                raise ValueError(f"link {link} has a non-positive rate; give its nominal GB/s")

    @property
    def device_count(self) -> int:
        """Number of devices."""
        return len(self.devices)

    def host_link(self, device: int) -> Link | None:
        """The direct host link of ``device`` (the fastest if several), or None."""
        candidates = [l for l in self.links if l.connects(HOST, device)]
        return max(candidates, key=lambda l: l.GBps, default=None)

    def peer_link(self, a: int, b: int) -> Link | None:
        """The fastest direct link between devices ``a`` and ``b``, or None."""
        candidates = [l for l in self.links if a != b and l.connects(a, b)]
        return max(candidates, key=lambda l: l.GBps, default=None)

    def peers(self, device: int) -> list[int]:
        """Devices with a direct peer link to ``device``, by index."""
        return sorted(d.index for d in self.devices if self.peer_link(device, d.index) is not None)

    def to_dict(self) -> dict[str, Any]:
        """A plain-JSON form; :meth:`from_dict` reverses it exactly."""
        return {
            "source": self.source,
            "host_mem_GBps": self.host_mem_GBps,
            "devices": [asdict(d) for d in self.devices],
            "links": [asdict(l) for l in self.links],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        """Build a topology from :meth:`to_dict` output (or a hand-written layout)."""
        return cls(
            devices=tuple(DeviceSpec(**d) for d in data["devices"]),
            links=tuple(Link(**l) for l in data["links"]),
            host_mem_GBps=data.get("host_mem_GBps"),
            source=data.get("source", "declared"),
            extra=dict(data.get("extra", {})),
        )

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def uniform(
        cls,
        n: int,
        *,
        device_bytes: int,
        host: tuple[str, float],
        peer: tuple[str, float] | None = None,
        device_name: str = "device",
        host_mem_GBps: float | None = None,
        shared_host: bool = False,
        source: str = "declared",
    ) -> "Topology":
        """``n`` identical devices, each with its own host link, all-to-all peer links.

        Args:
            n: device count.
            device_bytes: memory per device.
            host: ``(kind, GB/s)`` of each device's host link.
            peer: ``(kind, GB/s)`` of each device pair, or None for no peer links.
            device_name: product name of every device.
            host_mem_GBps: aggregate host-memory bandwidth, if it bounds concurrent links.
            shared_host: all host links share one resource (one root port).
            source: recorded in :attr:`source`.
        """
        if n < 1:
            raise ValueError(f"a topology needs at least one device, got n={n}")
        devices = tuple(DeviceSpec(i, device_name, device_bytes) for i in range(n))
        links: list[Link] = [
            Link(HOST, i, host[0], host[1], shared="host-root" if shared_host else None) for i in range(n)
        ]
        if peer is not None:
            links += [Link(a, b, peer[0], peer[1]) for a in range(n) for b in range(a + 1, n)]
        return cls(devices, tuple(links), host_mem_GBps=host_mem_GBps, source=source)

    def describe(self) -> Iterable[str]:
        """Human-readable lines, one per link."""
        for link in self.links:
            detail = f" ({link.detail})" if link.detail else ""
            yield f"{link.src} <-> {link.dst}: {link.kind} {link.GBps:g} GB/s{detail}"


def _dgx_h100(n: int) -> Topology:
    # PCIe Gen5 x16 per GPU (~55 GB/s measured on our H200); NVLink4 through NVSwitch,
    # 450 GB/s per direction per GPU (vendor figure: 900 GB/s bidirectional).
    return Topology.uniform(n, device_bytes=80 * 10**9, host=("pcie", 55.0), peer=("nvswitch", 450.0),
                            device_name="NVIDIA H100", host_mem_GBps=400.0, source="preset:dgx-h100")


def _dgx_h200(n: int) -> Topology:
    topo = _dgx_h100(n)
    devices = tuple(DeviceSpec(d.index, "NVIDIA H200", 141 * 10**9) for d in topo.devices)
    return Topology(devices, topo.links, topo.host_mem_GBps, "preset:dgx-h200")


def _cloudmatrix(n: int) -> Topology:
    # Vendor-reported: ~196 GB/s of Unified Bus per 910C die, host (Kunpeng) traffic rides UB
    # too (~160 GB/s per CPU, 4 CPUs per 8-NPU node). Not measured by us.
    return Topology.uniform(n, device_bytes=64 * 10**9, host=("ub", 160.0), peer=("ub", 196.0),
                            device_name="Ascend 910C die", host_mem_GBps=640.0, source="preset:cloudmatrix384")


#: Named layouts for tests and the scaleup simulator; values are functions of device count.
PRESETS = {"dgx-h100": _dgx_h100, "dgx-h200": _dgx_h200, "cloudmatrix384": _cloudmatrix}


def preset(name: str, n: int) -> Topology:
    """A named layout with ``n`` devices (see :data:`PRESETS`).

    Raises:
        ValueError: ``name`` is not one of :data:`PRESETS`.
    """
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown topology preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
    return factory(n)
