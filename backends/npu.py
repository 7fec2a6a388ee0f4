"""Huawei Ascend NPUs through torch_npu (``torch.npu``) and CANN, with ``npu-smi`` for topology.

Status: NOT RUN ON ASCEND HARDWARE. No line of this file has executed against a real NPU,
a real torch_npu, a real CANN runtime or a real ``npu-smi``. What has been checked, on a
CPU-only machine, against the recording stand-in ``tests/fake_torch_npu.py``:

* which ``torch.npu`` calls each verb makes and with which arguments (device index, stream
  priority, event timing flag, memory fraction and device, peer queries in both directions);
* the host-registration arithmetic: 4 KiB-aligned start, size padded to 4 KiB, flag
  ``ACL_HOST_REG_MAPPED`` (0x2), return codes checked, unregistration on free and on garbage
  collection, refusal of page spans that partly overlap an earlier registration;
* ``unavailable_reason`` for a missing torch_npu, zero devices and a non-ascending
  ``ASCEND_RT_VISIBLE_DEVICES``;
* that :meth:`NpuBackend.copy` (the base class's) is non-blocking only when every host side
  is pinned or registered here: on NPU a non-blocking copy from memory the runtime does
  not see as pinned silently synchronises the stream;
* ``parse_npu_smi_topo`` on an 8 x 910B3 sample published in the ms-swift docs (HCCS full
  mesh, CPU-affinity column), an A3 sample with ``Phy-ID`` labels and ``SIO`` from an sglang
  issue, and a hand-written PIX/PHB/SYS sample; remapping through
  ``ASCEND_RT_VISIBLE_DEVICES``.

Things a first run on Ascend must confirm (each is an assumption written down where it is
used): that ``tensor.is_pinned()`` reports memory registered through ``npuHostRegister``;
that mmap'd memory registers with MAPPED on the host's kernel (CANN requires
``aclrtMallocHost`` memory on kernels <= 5.10, which would make :meth:`alloc_pinned` fall
back to torch's pinned allocator); that ``npu-smi`` lists devices in the runtime's logical
order; the device-name strings the nominal-rate table keys on; and every nominal rate.
Also unverified: that ``npuHostRegister``/``npuHostUnregister``, which bypass torch_npu's
task queue (``TASK_QUEUE_ENABLE``), are safely ordered with copies queued through it; this
file assumes callers free or unregister memory only after the copies using it completed.

Device tensors come from ``torch.empty``, which torch_npu creates in the base ND format, so
copies to and from host buffers avoid the private-format (NZ/5HD) conversion paths.

Host memory: exact-size buffers are page-aligned anonymous mappings registered with
``torch.npu.npurt().npuHostRegister(ptr, size, ACL_HOST_REG_MAPPED)`` (``aclrtHostRegisterV2``),
so they are DMA-fast and never rounded up to a power of two as torch_npu's caching host
allocator does. ``npurt`` exists only on torch_npu master and some dev branches (not the
``v2.x.0-26.x.0`` release branches), so without it buffers come from
``torch.empty(..., pin_memory=True)``.

Direct Host Access (``caps.dha``, :meth:`NpuBackend.device_view`) is granted only when
vllm-ascend's ``torch.ops._C_ascend.get_npu_view_from_cpu_tensor`` is registered in this
process; see :meth:`NpuBackend.dha_routes` for exactly what is checked.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import re
import subprocess
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from xpu.backend import Backend, MemoryStats
from xpu.capabilities import Capabilities
from xpu.errors import CapabilityError, XpuError
from xpu.hostmem import anonymous_mapping
from xpu.topology import HOST, DeviceSpec, Link, Topology

__all__ = [
    "NpuBackend",
    "NpuSmiTopo",
    "SocRates",
    "parse_npu_smi_topo",
    "npu_smi_peer_links",
    "soc_rates",
    "numa_node_of_cpus",
    "ACL_HOST_REG_MAPPED",
    "HOST_REGISTER_ALIGN",
    "NPU_SMI_CODES",
]

_log = logging.getLogger("xpu")

#: ``aclrtHostRegisterV2`` flag: page-lock the range and map it into the device's address
#: space. MAPPED rather than PINNED because DeepSpeed measured PINNED-only registrations of
#: 64 MiB falling back to about 8-9 GB/s H2D on a 910B4, against about 23 GB/s for MAPPED.
ACL_HOST_REG_MAPPED = 0x2
#: CANN requires MAPPED registrations to start on a 4 KiB boundary.
HOST_REGISTER_ALIGN = 4096
_ACL_SUCCESS = 0

#: The environment variable torch_npu reads to restrict and order visible NPUs.
_VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
_ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"
#: Seconds to wait for ``npu-smi``; it talks to the driver and can hang on a sick device.
_NPU_SMI_TIMEOUT_S = 10.0

_NOMINAL = "nominal, vendor-reported, not measured"


# ---------------------------------------------------------------------------- small helpers
def _npu() -> Any:
    """``torch.npu`` as torch_npu installs it (looked up late: this module imports without it)."""
    return torch.npu  # type: ignore[attr-defined]


def _visible_devices() -> tuple[list[int] | None, str | None]:
    """Parse ``ASCEND_RT_VISIBLE_DEVICES``: ``(ids or None if unset, None)`` or ``(None, why it is unusable)``."""
    raw = os.environ.get(_VISIBLE_ENV)
    if raw is None:
        return None, None
    if not raw.strip():
        return None, f"{_VISIBLE_ENV} is set but empty, which hides every NPU; unset it or list device ids such as '0,1'"
    try:
        ids = [int(part) for part in raw.split(",")]
    except ValueError:
        return None, f"{_VISIBLE_ENV}={raw!r} is not a comma-separated list of device ids such as '0,1,2'"
    if any(i < 0 for i in ids):
        return None, f"{_VISIBLE_ENV}={raw!r} lists a negative device id"
    # torch_npu counts devices through the HAL (drvGetDevNum), which returns 0 unless the
    # list is strictly ascending; unlike CUDA_VISIBLE_DEVICES it cannot reorder devices.
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return None, (
            f"{_VISIBLE_ENV}={raw!r} is not strictly ascending; torch_npu's device count (the HAL "
            f"drvGetDevNum path) returns 0 devices then. List each id once, in increasing order, "
            f"e.g. {','.join(str(i) for i in sorted(set(ids)))!r}"
        )
    return ids, None


def _page_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 4 KiB-aligned ``(start, size)`` covering ``[ptr, ptr + nbytes)``.

    The address is rounded down and the end up, as DeepSpeed's NativePinnedMemory does for
    ``aclrtHostRegisterV2`` (PR #8532): the registration then covers whole pages, which may
    include bytes of neighbouring allocations in the first and last page.
    """
    start = ptr - ptr % HOST_REGISTER_ALIGN
    end = -(-(ptr + nbytes) // HOST_REGISTER_ALIGN) * HOST_REGISTER_ALIGN
    return start, end - start


def _pinned_by_torch(nbytes: int) -> torch.Tensor:
    """A pinned uint8 host tensor from torch_npu's caching host allocator.

    The tensor has exactly ``nbytes`` elements, but the allocator may reserve more behind it
    (it rounds blocks up, to a power of two below ``pinned_max_round_threshold_mb`` on
    torch_npu >= 26.2), so host memory use can exceed what the arena counts.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _vllm_ascend_view_op() -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """vllm-ascend's ``get_npu_view_from_cpu_tensor`` op if registered in this process, else None.

    Only looked up, never imported: importing ``vllm_ascend`` has side effects this library
    should not trigger. Import ``vllm_ascend.vllm_ascend_C`` before the backend's caps are
    first read to enable it.
    """
    return getattr(torch.ops._C_ascend, "get_npu_view_from_cpu_tensor", None)


def _alloc_conf_has_pinned_register() -> bool:
    """Whether ``PYTORCH_NPU_ALLOC_CONF`` contains ``pinned_mem_register:True``."""
    for item in os.environ.get(_ALLOC_CONF_ENV, "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "pinned_mem_register" and value.strip().lower() == "true":
            return True
    return False


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
            raise ValueError(f"{_VISIBLE_ENV} names device {v}, but npu-smi lists {count} device(s) ({', '.join(labels)})")
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


# ---------------------------------------------------------------------------- the backend
@dataclass
class _Registration:
    """One ``npuHostRegister`` call this backend made and must undo."""

    start: int
    size: int
    npurt: Any  # the runtime module that registered it, which must also unregister it
    owner: Any = None  # an mmap this backend allocated; dropped only after unregistering
    finalizer: weakref.finalize | None = None


class NpuBackend(Backend):
    """Huawei Ascend NPUs through torch_npu; see the module docstring for what is verified."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = _VISIBLE_ENV
    virtual_devices = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None if torch_npu sees at least one NPU, else a sentence saying what is missing.

        Imports torch_npu (which registers the ``npu`` device type but initialises no
        device) and asks for the device count, which torch_npu answers from the HAL without
        starting the ACL runtime.
        """
        try:
            import torch_npu  # noqa: F401  -- imported for its side effect: it registers torch.npu
        except Exception as exc:  # ImportError, or OSError from a missing CANN library
            return (f"torch_npu could not be imported ({type(exc).__name__}: {exc}); install torch_npu "
                    f"matching torch {torch.__version__} and source the CANN set_env.sh")
        if not hasattr(torch, "npu"):
            return "torch_npu was imported but did not install torch.npu; check that its version matches torch"
        _, why = _visible_devices()
        if why is not None:
            return why
        npu = _npu()
        if not npu.is_available() or npu.device_count() == 0:
            visible = os.environ.get(_VISIBLE_ENV)
            hint = f" ({_VISIBLE_ENV}={visible!r})" if visible is not None else ""
            return f"torch_npu sees no NPU{hint}: check the driver and devices with 'npu-smi info'"
        return None

    def __init__(self) -> None:
        super().__init__()
        # Re-entrant: a storage's finalizer (which unregisters) can run on this thread at any
        # point where an object is freed, including while the lock is held.
        self._reg_lock = threading.RLock()
        self._registrations: dict[int, _Registration] = {}  # start -> registration
        self._reg_starts: list[int] = []  # sorted keys of _registrations, for range lookups
        self._tensor_regs: dict[tuple[int, int], int] = {}  # (data_ptr, nbytes) -> start
        self._mmap_register_ok = True  # False after the first failed mapped registration
        self._topology: Topology | None = None

    # ------------------------------------------------------------------ capabilities
    def dha_routes(self) -> dict[str, str | None]:
        """For each way to build a device view of host memory: None if usable, else why not.

        * ``"vllm_ascend_op"``: ``torch.ops._C_ascend.get_npu_view_from_cpu_tensor`` is
          registered (``hasattr`` on the op namespace; vllm-ascend's C extension must have
          been imported). It calls ``aclrtHostGetDevicePointer`` and builds an NPU tensor
          whose deleter keeps the CPU tensor alive. This is the route ``device_view`` uses.
        * ``"npurt_pinned_register"``: ``hasattr(torch.npu, "npurt")``, ``PYTORCH_NPU_ALLOC_CONF``
          contains ``pinned_mem_register:True`` (pinned blocks are then registered MAPPED) and
          ``torch.npu.npurt()`` has a device-pointer getter (``npuHostGetDevicePointer``).
          Reported for diagnosis but never usable here: even with the pointer, torch_npu
          has no Python constructor for an NPU tensor over a foreign address that keeps the
          host memory alive, so this route never sets ``caps.dha``.
        """
        routes: dict[str, str | None] = {}
        routes["vllm_ascend_op"] = None if _vllm_ascend_view_op() is not None else (
            "torch.ops._C_ascend.get_npu_view_from_cpu_tensor is not registered (import vllm_ascend.vllm_ascend_C first)")
        npu = _npu()
        if not hasattr(npu, "npurt"):
            routes["npurt_pinned_register"] = "torch.npu.npurt is absent in this torch_npu build"
        elif not _alloc_conf_has_pinned_register():
            routes["npurt_pinned_register"] = f"{_ALLOC_CONF_ENV} does not contain pinned_mem_register:True"
        elif not hasattr(npu.npurt(), "npuHostGetDevicePointer"):
            routes["npurt_pinned_register"] = "torch.npu.npurt() exposes no device-pointer getter (aclrtHostGetDevicePointer)"
        else:
            routes["npurt_pinned_register"] = "prerequisites present, but no Python way to build an owning NPU tensor; unused"
        return routes

    def _detect_caps(self) -> Capabilities:
        """Capabilities from what torch_npu exposes here (see :meth:`dha_routes` for DHA).

        ``peer_access`` needs one pair that can reach each other both ways
        (``can_device_access_peer(a, b)`` and ``(b, a)``): torch_npu enables peer access on
        both sides or not at all. ``ipc`` stays False: whether ``torch.npu.Event`` and
        tensors can be shared across processes on a given CANN is unverified.

        The peer queries talk to the runtime, so in a process that forks workers read
        ``caps`` after the fork: torch_npu cannot re-initialise in a forked child.
        """
        npu = _npu()
        n = self.device_count()
        peer = any(npu.can_device_access_peer(a, b) and npu.can_device_access_peer(b, a)
                   for a in range(n) for b in range(a + 1, n))
        return Capabilities(dha=self.dha_routes()["vllm_ascend_op"] is None, peer_access=peer, ipc=False,
                            async_copy=True, host_register=hasattr(npu, "npurt"), timing_events=True)

    # ------------------------------------------------------------------ identity
    def device_count(self) -> int:
        """Number of NPUs torch_npu sees (after ``ASCEND_RT_VISIBLE_DEVICES``)."""
        return int(_npu().device_count())

    def current_device(self) -> int:
        """Index of the current NPU (``torch.npu.current_device``)."""
        return int(_npu().current_device())

    def device_scope(self, index: Any) -> contextlib.AbstractContextManager:
        """Context in which NPU ``index`` is current (``torch.npu.device``)."""
        return _npu().device(self.index_of(index))

    def bind_process(self, index: Any) -> None:
        """Make NPU ``index`` this process's current device (``torch.npu.set_device``; HCCL stages on it)."""
        _npu().set_device(self.index_of(index))

    # ------------------------------------------------------------------ streams and events
    def stream(self, device: Any = None, priority: int = 0) -> Any:
        """A new ``torch.npu.Stream`` on ``device``; lower ``priority`` numbers run first.

        The device goes in as an index: torch_npu's Stream enters ``torch.npu.device(index)``
        itself, and an index needs no ``npu`` device type registered to be built.
        """
        return _npu().Stream(device=self.index_of(device), priority=priority)

    def current_stream(self, device: Any = None) -> Any:
        """The stream work is queued on now for ``device`` (``torch.npu.current_stream``)."""
        return _npu().current_stream(self.index_of(device))

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (``torch.npu.stream``)."""
        return _npu().stream(stream)

    def event(self, timing: bool = False) -> Any:
        """A new ``torch.npu.Event``; ``timing=True`` enables ``elapsed_time``."""
        return _npu().Event(enable_timing=timing)

    def synchronize(self, device: Any = None) -> None:
        """Block until all work queued on ``device`` has finished (``aclrtSynchronizeDevice``)."""
        _npu().synchronize(self.index_of(device))

    # ------------------------------------------------------------------ host memory
    def _npurt(self) -> Any:
        """``torch.npu.npurt()``, or CapabilityError where this torch_npu lacks it."""
        npu = _npu()
        if not hasattr(npu, "npurt"):
            raise CapabilityError(
                "this torch_npu has no torch.npu.npurt() (it is on torch_npu master and some dev branches, not the "
                "v2.x.0-26.x.0 release branches), so host memory cannot be registered in place; use alloc_pinned or host_arena"
            )
        return npu.npurt()

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of exactly ``nbytes`` bytes, as a uint8 CPU tensor.

        With ``npurt``: a page-aligned anonymous mapping of ``nbytes`` bytes, registered
        MAPPED over its 4 KiB-padded span; unregistered by :meth:`free_pinned` or when the
        buffer is garbage-collected. If that registration fails once (CANN on host kernels
        <= 5.10 accepts only ``aclrtMallocHost`` memory), this and later calls fall back,
        with one warning, to torch_npu's pinned allocator, which may round the block up.
        Without ``npurt``: torch_npu's pinned allocator directly.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"alloc_pinned needs a non-negative size, got {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if not hasattr(_npu(), "npurt") or not self._mmap_register_ok:
            return _pinned_by_torch(nbytes)
        # An anonymous mapping is page-aligned, so no two buffers share a page and each can
        # be registered and unregistered on its own.
        mapping = anonymous_mapping(nbytes)  # huge pages if XPU_HOST_HUGEPAGES=1
        buf = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        try:
            self._register_span(buf, owner=mapping)
        except XpuError as exc:
            self._mmap_register_ok = False
            _log.warning("xpu npu: %s; falling back to torch_npu's pinned allocator, which may round buffers up", exc)
            return _pinned_by_torch(nbytes)
        return buf

    def free_pinned(self, buffer: torch.Tensor) -> None:
        """Unregister a buffer from :meth:`alloc_pinned` now (no-op for torch-allocated ones).

        The memory itself is unmapped once the last view of it is gone. Call it only after
        every copy that uses the buffer has completed (an event on the copy's stream): the
        unregistration is a raw runtime call, not ordered with work queued on streams.
        """
        self._release(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def register_host(self, tensor: torch.Tensor) -> None:
        """Page-lock and device-map an existing contiguous host tensor in place.

        Registers the 4 KiB-aligned span around the tensor with ``npuHostRegister(start,
        padded_size, ACL_HOST_REG_MAPPED)``; the registration is undone by
        :meth:`unregister_host` or when the tensor's storage is garbage-collected. No-op for
        tensors torch already pins and for memory inside an earlier registration.

        Raises:
            CapabilityError: this torch_npu has no ``npurt``.
            ValueError: not a contiguous CPU tensor, or its page span partly overlaps an
                earlier registration (neighbouring small tensors share pages; register the
                enclosing buffer once instead).
            XpuError: ``npuHostRegister`` returned an error code.
        """
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous host tensor")
        self._npurt()  # the capability check comes before any other outcome
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.is_pinned() or self._covering(tensor.data_ptr(), nbytes) is not None:
            return
        self._register_span(tensor, owner=None)

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host` for this tensor; call before its memory is freed.

        Call it only after every copy that uses the tensor has completed. No-op for a
        tensor this backend did not register (a view inside a registered buffer, say).

        Raises:
            CapabilityError: this torch_npu has no ``npurt``.
            XpuError: ``npuHostUnregister`` returned an error code (the pages stay
                registered and the registration is kept on record).
        """
        self._npurt()
        self._release(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory this backend registered or torch_npu pinned.

        Registered ranges are checked first because whether ``Tensor.is_pinned()`` reports
        ``npuHostRegister``'d memory is unverified; :meth:`copy` relies on this answer, and
        on NPU a non-blocking copy from memory the runtime does not see as pinned silently
        synchronises.
        """
        if tensor.device.type != "cpu":
            return False
        nbytes = tensor.numel() * tensor.element_size()
        return self._covering(tensor.data_ptr(), nbytes) is not None or tensor.is_pinned()

    def _covering(self, ptr: int, nbytes: int) -> _Registration | None:
        """The registration whose span contains ``[ptr, ptr + nbytes)``, or None."""
        with self._reg_lock:
            i = bisect.bisect_right(self._reg_starts, ptr) - 1
            if i < 0:
                return None
            reg = self._registrations[self._reg_starts[i]]
            return reg if ptr + nbytes <= reg.start + reg.size else None

    def _register_span(self, tensor: torch.Tensor, owner: Any) -> None:
        """Register ``tensor``'s page span with MAPPED and arrange its unregistration."""
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        start, size = _page_span(ptr, nbytes)
        npurt = self._npurt()
        with self._reg_lock:
            i = bisect.bisect_left(self._reg_starts, start)
            for j in (i - 1, i):
                if 0 <= j < len(self._reg_starts):
                    other = self._registrations[self._reg_starts[j]]
                    if other.start < start + size and start < other.start + other.size:
                        raise ValueError(
                            f"host span [{start:#x}, {start + size:#x}) of this tensor overlaps an earlier registration "
                            f"[{other.start:#x}, {other.start + other.size:#x}): tensors sharing a 4 KiB page cannot be "
                            f"registered separately; register the buffer that holds them both, once"
                        )
            rc = int(npurt.npuHostRegister(start, size, ACL_HOST_REG_MAPPED))
            if rc != _ACL_SUCCESS:
                raise XpuError(
                    f"npuHostRegister({size} B, ACL_HOST_REG_MAPPED) failed with ACL error {rc}; likely causes: a host kernel "
                    f"<= 5.10 (CANN then accepts only aclrtMallocHost memory), a driver/CANN without aclrtHostRegisterV2, "
                    f"or the memlock limit (ulimit -l)"
                )
            reg = _Registration(start, size, npurt, owner)
            self._registrations[start] = reg
            bisect.insort(self._reg_starts, start)
            self._tensor_regs[(ptr, nbytes)] = start
        # Unregister before the pages can return to the system allocator; the finalizer
        # fires when the last view of the storage dies (an mmap owner is held until then).
        reg.finalizer = weakref.finalize(tensor.untyped_storage(), self._unregister_start, start, (ptr, nbytes))
        # At interpreter exit the process lets go of its pages anyway, and torch_npu's runtime
        # may already be torn down; do not call into it then.
        reg.finalizer.atexit = False

    def _release(self, ptr: int, nbytes: int) -> None:
        """Unregister the registration made for exactly ``(ptr, nbytes)`` now, if any.

        On failure the error propagates and the finalizer stays armed, so a retry (or the
        garbage collector) can still undo the registration.
        """
        with self._reg_lock:
            start = self._tensor_regs.get((ptr, nbytes))
            reg = self._registrations.get(start) if start is not None else None
        if reg is None:
            return
        self._unregister_start(reg.start, (ptr, nbytes))
        if reg.finalizer is not None:
            reg.finalizer.detach()

    def _unregister_start(self, start: int, key: tuple[int, int]) -> None:
        """``npuHostUnregister`` one registration and forget it (its mmap may then be unmapped)."""
        with self._reg_lock:
            reg = self._registrations.get(start)
            if reg is None:
                return
            rc = int(reg.npurt.npuHostUnregister(start))
            if rc != _ACL_SUCCESS:
                # Keep the record (and any mmap owner) so these pages are not handed back to the
                # system while the driver still holds them.
                raise XpuError(f"npuHostUnregister({start:#x}) failed with ACL error {rc}; the pages stay registered")
            del self._registrations[start]
            self._reg_starts.remove(start)
            self._tensor_regs.pop(key, None)
            reg.owner = None

    def device_view(self, host_tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        """An NPU tensor aliasing pinned, device-mapped ``host_tensor`` (no copy).

        Uses vllm-ascend's ``get_npu_view_from_cpu_tensor`` on ``device`` (made current for
        the call); the view's deleter keeps ``host_tensor`` alive. The mapped address is for
        kernel access only: CANN documents that it "cannot be used for memory operations
        such as memcpy", so do not ``copy_`` into or out of the view; use :meth:`copy` on
        the host tensor. Each kernel access crosses the host link.

        Raises:
            CapabilityError: ``caps.dha`` is false (the message lists what is missing).
            ValueError: ``host_tensor`` is not pinned host memory, or it is pinned but not
                device-mapped (register it with :meth:`register_host`, allocate it with
                :meth:`alloc_pinned`, or set ``pinned_mem_register:True``).
        """
        if not self.caps.dha:
            routes = "; ".join(f"{k}: {v}" for k, v in self.dha_routes().items() if v is not None)
            raise CapabilityError(
                f"backend 'npu' has no Direct Host Access here (caps.dha is False: {routes}); copy the tensor to the "
                f"device with copy()/to_device() instead"
            )
        index = self.index_of(device)
        if host_tensor.device.type != "cpu" or not self.is_pinned(host_tensor):
            raise ValueError("device_view needs pinned host memory; allocate it from host_arena or register_host it first")
        if host_tensor.untyped_storage().nbytes() == 0:
            return torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device(index))
        op = _vllm_ascend_view_op()
        with self.device_scope(index):
            view = op(host_tensor)
        if view is None:
            raise ValueError(
                "host memory is pinned but not device-mapped: register it with register_host (MAPPED), allocate it "
                "with alloc_pinned, or set PYTORCH_NPU_ALLOC_CONF=pinned_mem_register:True before pinning"
            )
        return view

    # ------------------------------------------------------------------ peers
    def can_access_peer(self, a: Any, b: Any) -> bool:
        """Whether NPUs ``a`` and ``b`` can reach each other directly, checked in both directions.

        torch_npu enables peer access on both sides together, so a one-way answer is no use.
        """
        a, b = self.index_of(a), self.index_of(b)
        npu = _npu()
        return a != b and bool(npu.can_device_access_peer(a, b)) and bool(npu.can_device_access_peer(b, a))

    def enable_peer_access(self, a: Any, b: Any) -> bool:
        """Report whether ``a`` and ``b`` can use peer access; nothing is enabled explicitly.

        torch_npu enables it lazily, on both sides, at the first cross-device ``copy_``
        (``aclrtDeviceEnablePeerAccess``). Before A3 a device can enable at most 8 peers;
        beyond that torch_npu logs an error and copies without P2P.
        """
        return self.can_access_peer(a, b)

    # ------------------------------------------------------------------ memory
    def _raw_mem_info(self, index: int) -> tuple[int, int]:
        """Device-wide ``(free, total)`` from ``aclrtGetMemInfo(ACL_HBM_MEM)``."""
        free, total = _npu().mem_get_info(index)
        return int(free), int(total)

    def memory_stats(self, device: Any = None) -> MemoryStats:
        """This process's allocator figures, asked of ``torch.npu`` directly.

        Older torch_npu may not route ``torch.accelerator.memory`` to its allocator.
        """
        i = self.index_of(device)
        npu = _npu()
        return MemoryStats(int(npu.memory_allocated(i)), int(npu.memory_reserved(i)),
                           int(npu.max_memory_allocated(i)), int(npu.max_memory_reserved(i)))

    def reset_peak_memory(self, device: Any = None) -> None:
        """Start the peaks of :meth:`memory_stats` afresh."""
        _npu().reset_peak_memory_stats(self.index_of(device))

    def _apply_memory_cap(self, index: int, nbytes: int | None) -> None:
        """``torch.npu.set_per_process_memory_fraction(nbytes / total, index)``.

        The total is ``mem_get_info``'s, because torch_npu multiplies the fraction by the
        total it reads from ``aclrtGetMemInfo(ACL_HBM_MEM)``.
        """
        total = self._raw_mem_info(index)[1]
        _npu().set_per_process_memory_fraction(1.0 if nbytes is None else nbytes / total, index)

    # ------------------------------------------------------------------ topology
    def topology(self) -> Topology:
        """Devices from ``torch.npu.get_device_properties``, links from ``npu-smi info -t topo``.

        Host links and peer rates are nominal, from :func:`soc_rates`. Without a usable
        npu-smi the result has devices and host links only, and ``source`` says why.
        Computed once per process.
        """
        if self._topology is None:
            self._topology = self._build_topology()
        return self._topology

    def _build_topology(self) -> Topology:
        npu = _npu()
        n = self.device_count()
        props = [npu.get_device_properties(i) for i in range(n)]
        names = [str(getattr(p, "name", "") or "Ascend NPU") for p in props]
        visible, _ = _visible_devices()
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

    # ------------------------------------------------------------------ misc
    def describe(self) -> dict[str, Any]:
        """The base summary plus how DHA and host registration were decided."""
        out = super().describe()
        out["dha_routes"] = self.dha_routes()
        out["npurt"] = hasattr(_npu(), "npurt")
        out[_ALLOC_CONF_ENV] = os.environ.get(_ALLOC_CONF_ENV)
        return out
