"""Where Ascend NPUs sit: ``ASCEND_RT_VISIBLE_DEVICES``, ``npu-smi`` topology, nominal link rates.

Status: NOT RUN ON ASCEND HARDWARE (see :mod:`backends.npu`). :func:`parse_npu_smi_topo` is
checked on an 8 x 910B3 sample published in the ms-swift docs (HCCS full mesh, CPU-affinity
column), an A3 sample with ``Phy-ID`` labels and ``SIO`` from an sglang issue, and a
hand-written PIX/PHB/SYS sample, with remapping through ``ASCEND_RT_VISIBLE_DEVICES``.
Unverified: that ``npu-smi`` lists devices in the runtime's logical order, the device-name
strings :func:`soc_rates` keys on, and every nominal rate.

Nothing here calls ``torch.npu``: :class:`~backends.npu.NpuBackend` reads the device
properties and hands them to :func:`build_topology`.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from xpu.topology import HOST, DeviceSpec, Link, Topology

__all__ = [
    "VISIBLE_ENV",
    "visible_devices",
    "NPU_SMI_CODES",
    "NpuSmiTopo",
    "parse_npu_smi_topo",
    "numa_node_of_cpus",
    "SocRates",
    "soc_rates",
    "npu_smi_peer_links",
    "build_topology",
]

#: The environment variable torch_npu reads to restrict and order visible NPUs.
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
#: Seconds to wait for ``npu-smi``; it talks to the driver and can hang on a sick device.
_NPU_SMI_TIMEOUT_S = 10.0

_NOMINAL = "nominal, vendor-reported, not measured"


# ---------------------------------------------------------------------------- visible devices
def visible_devices() -> tuple[list[int] | None, str | None]:
    """Parse ``ASCEND_RT_VISIBLE_DEVICES``: ``(ids or None if unset, None)`` or ``(None, why it is unusable)``."""
    raw = os.environ.get(VISIBLE_ENV)
    if raw is None:
        return None, None
    if not raw.strip():
        return None, f"{VISIBLE_ENV} is set but empty, which hides every NPU; unset it or list device ids such as '0,1'"
    try:
        ids = [int(part) for part in raw.split(",")]
    except ValueError:
        return None, f"{VISIBLE_ENV}={raw!r} is not a comma-separated list of device ids such as '0,1,2'"
    if any(i < 0 for i in ids):
        return None, f"{VISIBLE_ENV}={raw!r} lists a negative device id"
    # torch_npu counts devices through the HAL (drvGetDevNum), which returns 0 unless the
    # list is strictly ascending; unlike CUDA_VISIBLE_DEVICES it cannot reorder devices.
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return None, (
            f"{VISIBLE_ENV}={raw!r} is not strictly ascending; torch_npu's device count (the HAL "
            f"drvGetDevNum path) returns 0 devices then. List each id once, in increasing order, "
            f"e.g. {','.join(str(i) for i in sorted(set(ids)))!r}"
        )
    return ids, None


def _run_npu_smi_topo(timeout: float = _NPU_SMI_TIMEOUT_S) -> str:
    """Stdout of ``npu-smi info -t topo``.

    Raises:
        OSError: npu-smi is not installed (FileNotFoundError) or cannot run.
        subprocess.TimeoutExpired: it did not answer within ``timeout`` seconds.
        RuntimeError: it exited with a non-zero status (not supported on this product, no
            permission...); the message carries its stderr.
    """
    proc = subprocess.run(["npu-smi", "info", "-t", "topo"], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"'npu-smi info -t topo' exited with status {proc.returncode}: {tail[0][:200]}")
    return proc.stdout

# ---------------------------------------------------------------------------- npu-smi topology
#: Relation codes in the ``npu-smi info -t topo`` legend (A2 and A3 drivers).
NPU_SMI_CODES = frozenset({"X", "HCCS", "HCCS_SW", "SIO", "PIX", "PXB", "PHB", "SYS", "NA"})
_LABEL = re.compile(r"^[A-Za-z][A-Za-z_-]*?-?(\d+)$")  # NPU0, Phy-ID12


@dataclass(frozen=True)
class NpuSmiTopo:
    """The device matrix of ``npu-smi info -t topo``, re-indexed to logical device order.

    Attributes:
        labels: npu-smi's row label of each logical device (``"NPU3"``, ``"Phy-ID12"``).
        rows: the 0-based position of each logical device among npu-smi's rows.
        relations: ``relations[a][b]`` is npu-smi's code between logical devices ``a`` and
            ``b`` (``"X"`` on the diagonal; ``HCCS``, ``HCCS_SW``, ``SIO``, ``PIX``, ``PXB``,
            ``PHB``, ``SYS``, ``NA``, or whatever else the tool printed, upper-cased).
        cpu_affinity: the ``CPU Affinity`` column per logical device (``"144-167"``), or
            None where npu-smi prints no such column (A3 drivers seen so far).
    """

    labels: tuple[str, ...]
    rows: tuple[int, ...]
    relations: tuple[tuple[str, ...], ...]
    cpu_affinity: tuple[str | None, ...] = field(default=())

    @property
    def device_count(self) -> int:
        """Number of logical devices covered."""
        return len(self.labels)

    def relation(self, a: int, b: int) -> str:
        """npu-smi's code between logical devices ``a`` and ``b``."""
        return self.relations[a][b]


def _is_label(token: str) -> bool:
    return bool(_LABEL.match(token)) and token.upper() not in NPU_SMI_CODES


def parse_npu_smi_topo(text: str, visible: Sequence[int] | None = None) -> NpuSmiTopo:
    """Parse ``npu-smi info -t topo`` output and map its rows to logical device indices.

    The matrix header is the first line whose first two tokens are device labels (or one
    label followed by ``CPU Affinity``); each following line that starts with a label is a
    row; parsing stops at ``Legend:``. Labels may be ``NPU<n>`` (A2) or ``Phy-ID<n>`` (A3).

    Mapping: ``visible`` is the parsed ``ASCEND_RT_VISIBLE_DEVICES`` (None: unset). Its
    i-th id names logical device i and is read as a *position* among npu-smi's rows, which
    on a bare-metal host is also the number in ``NPU<n>``. Positions rather than label
    numbers because inside a container npu-smi prints host ids (``Phy-ID12``, ``Phy-ID13``)
    while the runtime numbers the mounted devices from 0. This assumes npu-smi lists devices
    in the runtime's logical order (unverified; ``npu-smi info -m`` has the authoritative
    mapping and is not read yet).

    Args:
        text: the tool's stdout.
        visible: device ids from ``ASCEND_RT_VISIBLE_DEVICES``, or None for all rows.

    Raises:
        ValueError: no matrix found, a malformed row, row labels that do not match the
            header, or a visible id beyond npu-smi's rows.
    """
    labels: list[str] | None = None
    has_cpu_column = False
    rows: list[tuple[str, list[str], str | None]] = []
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":").lower() == "legend":
            break
        if labels is None:
            second = tokens[1] if len(tokens) > 1 else ""
            if _is_label(tokens[0]) and (not second or _is_label(second) or second.upper() in ("CPU", "NUMA")):
                labels = []
                for token in tokens:
                    if not _is_label(token):
                        break
                    labels.append(token)
                has_cpu_column = "cpu affinity" in " ".join(tokens[len(labels):]).lower()
            continue
        if not _is_label(tokens[0]):
            continue
        n = len(labels)
        # Relation codes are words; the CPU-affinity column that follows starts with a digit,
        # so a short row cannot silently borrow it as a code.
        codes = []
        for token in tokens[1:1 + n]:
            if not token[0].isalpha():
                break
            codes.append(token.upper())
        if len(codes) < n:
            raise ValueError(f"npu-smi topo row {tokens[0]!r} has {len(codes)} entries for {n} devices: {line.strip()!r}")
        extras = tokens[1 + n:]
        rows.append((tokens[0], codes, extras[0] if has_cpu_column and extras else None))
    if not labels:
        raise ValueError("no device matrix found in 'npu-smi info -t topo' output")
    if [r[0] for r in rows] != labels:
        raise ValueError(f"npu-smi topo rows {[r[0] for r in rows]} do not match its columns {labels}")

    count = len(labels)
    order = list(range(count)) if visible is None else [int(v) for v in visible]
    for v in order:
        if not 0 <= v < count:
            raise ValueError(f"{VISIBLE_ENV} names device {v}, but npu-smi lists {count} device(s) ({', '.join(labels)})")
    return NpuSmiTopo(
        labels=tuple(labels[p] for p in order),
        rows=tuple(order),
        relations=tuple(tuple(rows[p][1][q] for q in order) for p in order),
        cpu_affinity=tuple(rows[p][2] for p in order),
    )


def _parse_cpu_list(text: str) -> set[int]:
    """``"0-23,96-119"`` -> the set of CPU numbers (Linux cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _host_numa_cpus(root: str = "/sys/devices/system/node") -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from sysfs (empty where sysfs is absent)."""
    nodes: dict[int, set[int]] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return nodes
    for entry in entries:
        match = re.fullmatch(r"node(\d+)", entry)
        if not match:
            continue
        try:
            with open(os.path.join(root, entry, "cpulist")) as fh:
                nodes[int(match.group(1))] = _parse_cpu_list(fh.read())
        except (OSError, ValueError):
            continue
    return nodes


def numa_node_of_cpus(cpu_affinity: str | None, nodes: Mapping[int, set[int]]) -> int | None:
    """The NUMA node holding every CPU of npu-smi's ``CPU Affinity`` entry, or None.

    None when the entry is missing or unreadable, or its CPUs span several nodes (or none).
    """
    if not cpu_affinity:
        return None
    try:
        cpus = _parse_cpu_list(cpu_affinity)
    except ValueError:
        return None
    matches = [node for node, members in nodes.items() if cpus and cpus <= members]
    return matches[0] if len(matches) == 1 else None


# ---------------------------------------------------------------------------- nominal rates
@dataclass(frozen=True)
class SocRates:
    """Nominal link rates for one Ascend SoC family (GB/s per direction; leads, not facts).

    Attributes:
        family: a readable family name.
        host: ``(kind, GB/s, detail)`` of each device's link to host memory.
        peer: npu-smi relation code -> ``(kind, GB/s, detail)`` of the peer link it implies.
            Codes absent here (``PHB``, ``SYS``, ``NA``) give no peer link.
    """

    family: str
    host: tuple[str, float, str]
    peer: Mapping[str, tuple[str, float, str]]


_PCIE5_X16 = 63.0  # 32 GT/s x 16 lanes after 128b/130b coding (64 GB/s raw), as the CUDA backend computes it
_PCIE4_X16 = 31.5


def soc_rates(device_name: str) -> SocRates:
    """Nominal rates for a device name from ``torch.npu.get_device_properties(i).name``.

    Keyed by substring: ``Ascend910_93`` (A3, one die of a 910C), ``Ascend910B`` (A2),
    anything else gets conservative placeholders marked as assumed. Sources are the
    research notes (xpu-anchors.md §3.5); none of these figures was measured by us.

    Peer kinds: ``HCCS``, ``HCCS_SW`` and ``SIO`` are real device-to-device links. ``PIX``
    and ``PXB`` (devices under one PCIe switch tree, not crossing the CPU) give a ``pcie``
    peer link at the PCIe rate: peer DMA there can avoid the host but shares the switch
    uplink. ``PHB`` and ``SYS`` (through the CPU's host bridge or across NUMA nodes) give no
    peer link: such traffic is no faster than staging through host memory, which the
    planner already models with the two host links.
    """
    name = device_name or ""
    pcie_switch_910b = ("pcie", _PCIE5_X16, f"PCIe peer-to-peer within one PCIe switch, at the host-link rate; {_NOMINAL}")
    if "Ascend910_93" in name:
        ub = f"~196 GB/s per die (392 GB/s per 910C, 14 x 28 GB/s links), shared by all of the die's peers; {_NOMINAL}"
        return SocRates(
            family="Ascend 910C die (Atlas A3)",
            host=("ub", 160.0, "Unified Bus to the Kunpeng host: ~160 GB/s per CPU (CloudMatrix384 figure), shared by "
                                f"the dies that CPU serves; not confirmed for standalone A3 servers; {_NOMINAL}"),
            peer={
                "SIO": ("sio", 196.0, "die-to-die inside one 910C package; no vendor SIO figure in our notes, the "
                                      "per-die UB figure is a placeholder; not measured"),
                "HCCS": ("hccs", 196.0, f"HCCS, {ub}"),
                "HCCS_SW": ("hccs_sw", 196.0, f"HCCS through a switch, {ub}"),
                "PIX": ("pcie", _PCIE5_X16, "PCIe peer-to-peer within one PCIe switch, assumed Gen5 x16; not measured"),
                "PXB": ("pcie", _PCIE5_X16, "PCIe peer-to-peer across PCIe switches, assumed Gen5 x16; not measured"),
            },
        )
    if "Ascend910B" in name:
        return SocRates(
            family="Ascend 910B (Atlas A2)",
            host=("pcie", _PCIE5_X16, f"PCIe Gen5 x16 (commonly cited for Atlas 800T A2, unverified); {_NOMINAL}"),
            peer={
                "HCCS": ("hccs", 56.0, f"HCCS full mesh: one 56 GB/s link per pair (7 x 56 = 392 GB/s per NPU); {_NOMINAL}"),
                "HCCS_SW": ("hccs_sw", 56.0, f"HCCS through a switch, per-link figure of the full mesh assumed; {_NOMINAL}"),
                "PIX": pcie_switch_910b,
                "PXB": ("pcie", _PCIE5_X16, f"PCIe peer-to-peer across PCIe switches, at the host-link rate; {_NOMINAL}"),
            },
        )
    assumed = f"assumed for unknown SoC {name!r}: one HCCS link at 28 GB/s (the per-link 910C figure); not measured"
    return SocRates(
        family=f"unknown Ascend SoC ({name!r})",
        host=("pcie", _PCIE4_X16, f"assumed PCIe Gen4 x16 for unknown SoC {name!r}; not measured"),
        peer={
            "HCCS": ("hccs", 28.0, assumed),
            "HCCS_SW": ("hccs_sw", 28.0, assumed),
            "SIO": ("sio", 28.0, assumed),
            "PIX": ("pcie", _PCIE4_X16, f"PCIe peer-to-peer within one PCIe switch, assumed Gen4 x16 for {name!r}; not measured"),
            "PXB": ("pcie", _PCIE4_X16, f"PCIe peer-to-peer across PCIe switches, assumed Gen4 x16 for {name!r}; not measured"),
        },
    )


def npu_smi_peer_links(topo: NpuSmiTopo, device_name: str) -> list[Link]:
    """Peer links (each pair once, ``a < b``) implied by npu-smi's matrix; see :func:`soc_rates`."""
    rates = soc_rates(device_name)
    links: list[Link] = []
    for a in range(topo.device_count):
        for b in range(a + 1, topo.device_count):
            entry = rates.peer.get(topo.relation(a, b))
            if entry is not None:
                kind, gbps, detail = entry
                links.append(Link(a, b, kind, gbps, detail=f"npu-smi {topo.relation(a, b)}: {detail}"))
    return links


# ---------------------------------------------------------------------------- the whole picture
def build_topology(props: Sequence[Any]) -> Topology:
    """Devices from their properties, links from ``npu-smi info -t topo`` and :func:`soc_rates`.

    Args:
        props: ``torch.npu.get_device_properties(i)`` for each logical device ``i`` (read:
            ``name``, ``total_memory`` and, where present, ``uuid``).

    Host links and peer rates are nominal. Without a usable npu-smi, or when its matrix
    maps to a different number of devices than ``props``, the result has devices and host
    links only, and ``source`` says why.
    """
    n = len(props)
    names = [str(getattr(p, "name", "") or "Ascend NPU") for p in props]
    visible, _ = visible_devices()
    parsed: NpuSmiTopo | None = None
    try:
        parsed = parse_npu_smi_topo(_run_npu_smi_topo(), visible)
        if parsed.device_count != n:
            raise ValueError(f"npu-smi maps to {parsed.device_count} device(s) but torch_npu sees {n}")
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
        parsed, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = ""
    numa = _host_numa_cpus() if parsed is not None else {}
    devices = tuple(
        DeviceSpec(i, names[i], int(props[i].total_memory),
                   numa_node=numa_node_of_cpus(parsed.cpu_affinity[i], numa) if parsed is not None else None,
                   uuid=str(getattr(props[i], "uuid", "") or "") or None)
        for i in range(n)
    )
    links: list[Link] = []
    for i in range(n):
        kind, gbps, detail = soc_rates(names[i]).host
        links.append(Link(HOST, i, kind, gbps, detail=detail))
    extra: dict[str, Any] = {"soc": soc_rates(names[0]).family if names else None, "rates": _NOMINAL}
    if parsed is None:
        return Topology(devices, tuple(links), source=f"torch_npu (npu-smi unavailable: {why})", extra=extra)
    links += npu_smi_peer_links(parsed, names[0])
    extra["npu_smi"] = {"labels": list(parsed.labels), "rows": list(parsed.rows),
                        "relations": [list(r) for r in parsed.relations], "cpu_affinity": list(parsed.cpu_affinity)}
    return Topology(devices, tuple(links), source="npu-smi", extra=extra)
