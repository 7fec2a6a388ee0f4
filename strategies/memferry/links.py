"""Measured link rates for MemFerry's cost model: :class:`Links`, read from ``xpu probe``'s cache.

Host->device and device->host copy rates, the DHA read rate and its matmul slow-down by M, and
the host's own memory rate (the probe's ``host`` section: triad on all cores, and what a link
byte cost it), which ``host_budget`` turns into host-memory time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xpu import Backend

__all__ = ["Links", "links_from_probe", "probed_links", "H200_DHA_ROWS"]

#: DHA matmul slow-down against copy-then-matmul, by M (rows), measured on the H200
#: (docs/design.md §3: 8192x8192 bf16 weight; 2.66/2.49 ms at M=64, 5.3/2.5 at 256, 42/3.1 at 4096,
#: 391/5.2 at 16384). Used only when no probe with ``dha_matmul`` rows is cached.
H200_DHA_ROWS: tuple[tuple[int, float], ...] = ((64, 2.66 / 2.49), (256, 5.3 / 2.5), (4096, 42 / 3.1),
                                                (16384, 391 / 5.2))


@dataclass(frozen=True)
class Links:
    """Measured transfer rates the cost model uses.

    Attributes:
        h2d_GBps: pinned host→device copy rate (10**9 B/s).
        d2h_GBps: pinned device→host copy rate.
        dha_read_GBps: rate of kernels reading pinned host memory (None: no DHA).
        dha_rows: ``(M, dha_ms / copy_then_matmul_ms)`` pairs, sorted by M.
        source: where the figures came from (``"probe"``, ``"topology"``, ``"given"``).
        host_GBps: host memory's triad rate on all cores (None: not probed; ``host_budget``).
        host_copy_weight: host-memory bytes a link byte cost the probe's triad (None: not probed).
        loaded_copy_GBps: one direction's copy rate beside host-memory traffic: half what the
            probe's copies moved both ways at once while its triad and AdamW ran (None: not
            probed). A streamed ``host_linear`` block is priced no faster, both passes (``block_costs``).
    """

    h2d_GBps: float
    d2h_GBps: float
    dha_read_GBps: float | None = None
    dha_rows: tuple[tuple[int, float], ...] = H200_DHA_ROWS
    source: str = "given"
    host_GBps: float | None = None
    host_copy_weight: float | None = None
    loaded_copy_GBps: float | None = None

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


def probed_links(probe: dict[str, Any], dha: bool = True) -> Links:
    """:class:`Links` from ``probe``'s figures (``xpu probe``'s JSON, with ``h2d_pinned_GBps``);
    ``dha``: the device reads host memory directly (``Capabilities.dha``), else no DHA rate.
    Replays of a logged run price its plan on that run's probe with this."""
    rows = tuple(sorted((int(r["M"]), float(r["dha_ms"]) / float(r["copy_then_matmul_ms"]))
                        for r in probe.get("dha_matmul", []) if r.get("dha_ms") and r.get("copy_then_matmul_ms")))
    return Links(float(probe["h2d_pinned_GBps"]), float(probe.get("d2h_pinned_GBps") or probe["h2d_pinned_GBps"]),
                 float(probe["dha_read_GBps"]) if dha and probe.get("dha_read_GBps") else None,
                 rows or H200_DHA_ROWS, "probe", *_host_figures(probe.get("host") or {}))


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
        return probed_links(probe, dha_ok)
    index = backend.index_of(device)
    link = backend.topology().host_link(index)
    if link is None:
        raise ValueError(f"no probe is cached for backend '{backend.name}' and its topology has no host link for "
                         f"device {index}; run `xpu probe` first")
    return Links(link.GBps, link.GBps, link.GBps if dha_ok else None, H200_DHA_ROWS, "topology")


def _host_figures(host: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """The probe's triad rate, the host-memory bytes a link byte cost it, and one direction's
    copy rate beside its host load (None: absent)."""
    triad, beside, copies = host.get("triad_GBps"), host.get("triad_with_copies_GBps"), host.get("copies_GBps")
    if not triad:
        return None, None, None
    weight = max(0.0, (triad - beside) / copies) if beside and copies else None
    return float(triad), weight, float(copies) / 2 if copies else None
