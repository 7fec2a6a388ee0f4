"""The multi-path benchmark's comparison and report: the simulator's predictions, the table, the plot.

Used by :mod:`bench.transfers.multipath`. Predictions are built as
:mod:`bench.transfers.predict` builds the published ones, on the same routes, chunk size,
window and policy priors as the measurement.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from xpu.topology import Topology
from scaleup import (PathSimulator, SplitPolicy, discover_routes, expected_aggregate_GBps, max_min_rates,
                     resource_capacities)

from .multipath_measure import fmt_size

__all__ = ["calibrated_topology", "predict_multipath", "predict_concurrent", "format_table", "plot"]


# ---------------------------------------------------------------------------------- predictions
def calibrated_topology(topo: Topology, links: Mapping[str, Any], host_mem_GBps: float | None) -> Topology:
    """``topo`` with measured rates: host links from ``links["h2d_GBps"]``, peer links from
    ``links["peer_GBps"]`` (the slower measured direction of a pair), host memory from
    ``host_mem_GBps`` (the all-at-once aggregate: what the host gave every device together)."""
    h2d, peer = links.get("h2d_GBps", {}), links.get("peer_GBps", {})
    new = []
    for link in topo.links:
        if link.is_host_link:
            dev = link.dst if link.src == "host" else link.src
            rate = h2d.get(str(dev))
        else:
            measured = [peer[k] for k in (f"{link.src}->{link.dst}", f"{link.dst}->{link.src}") if k in peer]
            rate = min(measured) if measured else None
        new.append(replace(link, GBps=float(rate), detail=f"measured ({link.detail})" if link.detail else "measured")
                   if rate and rate > 0 else link)
    return Topology(topo.devices, tuple(new), host_mem_GBps or topo.host_mem_GBps, topo.source + "+measured", dict(topo.extra))


def predict_multipath(topo: Topology, target: int, nbytes: int, *, chunk_bytes: int, window: int,
                      priors: Mapping[str, float] | None, route_names: Sequence[str] | None = None) -> dict[str, Any]:
    """The simulator's multipath transfer into ``target`` on ``topo``, as :mod:`bench.transfers.predict` builds it.

    The policy starts from ``priors`` (the copier's own starting estimates) and runs one
    simulated warm-up transfer before the reported one, as the measurement does. Only routes
    named in ``route_names`` are used (the routes the copier really had).
    """
    routes = discover_routes(topo, target)
    if route_names is not None:
        routes = [r for r in routes if r.name in set(route_names)]
    caps = resource_capacities(topo)
    prior = {r.name: (priors or {}).get(r.name, r.GBps) for r in routes}
    sim = PathSimulator(routes, caps, chunk_bytes=chunk_bytes, window=window, prior_GBps=prior)
    policy = SplitPolicy(prior)
    sim.run(nbytes, policy=policy)
    res = sim.run(nbytes, policy=policy)
    steady, _ = expected_aggregate_GBps(routes, caps)
    direct = next((r.GBps for r in routes if r.via is None), None)
    return {"GBps": round(res.GBps, 2), "steady_state_GBps": round(steady, 2),
            "direct_GBps": direct, "speedup": round(res.GBps / direct, 2) if direct else None,
            "bytes_per_route": res.bytes_per_route, "shares": {k: round(v, 4) for k, v in policy.shares().items()}}


def predict_concurrent(topo: Topology) -> dict[str, Any]:
    """Steady aggregate when every device loads over its own host link at once (max-min sharing)."""
    flows, limits = [], []
    for d in range(topo.device_count):
        direct = discover_routes(topo, d, peers=[])
        if direct:
            flows.append(direct[0].resources)
            limits.append(direct[0].GBps)
    if not flows:
        return {"aggregate_GBps": None, "per_device_GBps": None}
    rates = max_min_rates(flows, resource_capacities(topo), limits)
    return {"aggregate_GBps": round(sum(rates), 2), "per_device_GBps": round(sum(rates) / len(rates), 2)}


# ---------------------------------------------------------------------------------- output
def _pct(part: Mapping[str, int]) -> str:
    total = sum(part.values()) or 1
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in part.items())


def _num(x: Any, suffix: str = "") -> str:
    return "-" if x is None else f"{x:g}{suffix}"


def _pred(p: Mapping[str, Any]) -> str:
    """A prediction as ``GB/s (speed-up over its own direct link)``."""
    return f"{p['GBps']:g} ({p['speedup']:g}x)" if p.get("speedup") else _num(p.get("GBps"))


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary: one line per target and size, then route detail, then all-at-once."""
    lines = [f"scaleup multi-path bench — {result['machine']} — {result['date']} — torch {result['torch']}",
             "GB/s = 1e9 B/s; median of per-transfer wall times; 'pred' = path simulator "
             "(topo: reported link rates; links: this run's solo link rates)"]
    head = f"{'target':>6} {'size':>8} {'chunk':>8} {'direct':>8} {'copier-1':>8} {'multipath':>9} {'speed-up':>8} " \
           f"{'pred topo':>15} {'pred links':>10}" + (f" {'pred preset':>15}" if result.get("preset") else "") + "  bytes ok"
    lines.append(head)
    for r in result["rows"]:
        p = r["predicted"]
        ok = all(r[k]["verified"].get("ok") for k in ("direct", "copier_direct", "multipath") if k in r)
        line = (f"{r['target']:>6} {r['size']:>8} {fmt_size(r['chunk_bytes']):>8} {_num(r['direct']['GBps']):>8} "
                f"{_num(r.get('copier_direct', {}).get('GBps')):>8} {_num(r['multipath']['GBps']):>9} "
                f"{_num(r['speedup'], 'x'):>8} {_pred(p['topology']):>15} {_num(p['measured_links']['GBps']):>10}")
        if "preset" in p:
            line += f" {_pred(p['preset']):>15}"
        lines.append(line + f"  {'yes' if ok else 'NO'}")
    lines.append("routes (bytes of the last timed transfer; predicted by the topology model; policy's final shares):")
    for r in result["rows"]:
        mp = r["multipath"]
        lines.append(f"  target {r['target']} {r['size']}: measured {_pct(mp.get('bytes_per_route', {}))}")
        lines.append(f"  {'':>{len(str(r['target'])) + len(r['size']) + 8}}predicted {_pct(r['predicted']['topology']['bytes_per_route'])}")
        lines.append(f"  {'':>{len(str(r['target'])) + len(r['size']) + 8}}shares {' '.join(f'{k} {v:.2f}' for k, v in mp['shares'].items())}"
                     + (f"; dropped {mp['dropped_routes']}" if mp.get("dropped_routes") else ""))
    lines.append("all devices loading at once (each its own direct copy):")
    lines.append(f"{'size':>8} {'devices':>7} {'aggregate':>9} {'per device':>10} {'pred agg':>9} {'pred/device':>11}  bytes ok")
    for c in result["concurrent"]:
        pred = c["predicted"]["topology"]
        lines.append(f"{c['size']:>8} {c['devices']:>7} {_num(c['aggregate_GBps']):>9} {_num(c['per_device_GBps']):>10} "
                     f"{_num(pred['aggregate_GBps']):>9} {_num(pred['per_device_GBps']):>11}  {'yes' if c['verified'].get('ok') else 'NO'}"
                     + ("" if c["truly_concurrent"] else "  (this backend copies synchronously: not concurrent)"))
    links = result["links_measured"]
    lines.append(f"solo links ({fmt_size(links['size_bytes'])}): host->d " + " ".join(f"{k}:{v:g}" for k, v in links["h2d_GBps"].items())
                 + ("; peer " + " ".join(f"{k}:{v:g}" for k, v in links["peer_GBps"].items()) if links["peer_GBps"] else ""))
    if result["mismatches"]:
        lines.append(f"BYTE MISMATCH or transfer error in {len(result['mismatches'])} configuration(s); their GB/s are withheld:")
        lines.extend(f"  {json.dumps(m)}" for m in result["mismatches"])
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Measured vs predicted GB/s per target and size, and all-at-once per device (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    series = [("direct (engine)", lambda r: r["direct"]["GBps"]),
              ("multipath measured", lambda r: r["multipath"]["GBps"]),
              ("multipath predicted (topology)", lambda r: r["predicted"]["topology"]["GBps"]),
              ("multipath predicted (solo links)", lambda r: r["predicted"]["measured_links"]["GBps"])]
    width = 0.8 / len(series)
    for k, (label, get) in enumerate(series):
        ax.bar([i + k * width for i in range(len(rows))], [get(r) or 0 for r in rows], width, label=label,
               hatch="//" if "predicted" in label else None, alpha=0.6 if "predicted" in label else 1.0)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"dev {r['target']}\n{r['size']}" for r in rows])
    ax.set_ylabel("host→device GB/s into one device")
    ax.set_title("one device loading (peers idle): measured vs predicted", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    conc = result["concurrent"]
    ax2.bar([i - 0.2 for i in range(len(conc))], [c["per_device_GBps"] or 0 for c in conc], 0.4, label="measured")
    ax2.bar([i + 0.2 for i in range(len(conc))], [c["predicted"]["topology"]["per_device_GBps"] or 0 for c in conc], 0.4,
            hatch="//", alpha=0.6, label="predicted (topology)")
    ax2.set_xticks(range(len(conc)), [c["size"] for c in conc])
    ax2.legend(fontsize=8)
    ax2.set_title(f"all {conc[0]['devices'] if conc else '?'} devices at once:\nGB/s per device", fontsize=10)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{result['machine']} — {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

