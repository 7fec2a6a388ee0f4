"""Benchmark the multi-path copier against the direct route, with the simulator's prediction beside it.

    python -m scaleup.bench_multipath --out bench/results/DIR --preset dgx-h200   # on a multi-GPU node
    XPU_BACKEND=cpu python -m scaleup.bench_multipath --sizes 1MiB,4MiB --repeats 2   # smoke run

(Run ``xpu probe`` on the node first if you want the copier to start from measured rates, as it
does in use; without a cached probe it starts from the topology's nominal rates. The JSON
records which.) Memory: ``devices + 1`` pinned host buffers of the largest size (9 GiB for
1 GiB on 8 devices), one buffer of each size per device, and the copier's peer staging
(``window`` chunks per peer).

For each target device (``--targets``, default 0) and size (``--sizes``, default 64 MiB,
256 MiB, 1 GiB) it measures, on whatever backend is selected:

* **direct**: one pinned host→target copy through :class:`~scaleup.engine.TransferEngine`
  (the baseline a single host link gives), and the same through a
  :class:`~scaleup.multipath.MultiPathCopier` restricted to the direct route (the copier's
  own chunking overhead, with no relay to help);
* **multipath**: the copier with every discovered route (direct + host→peer→target through
  each peer with peer access), with bytes and chunks per route, dropped routes, and the
  policy's final shares and rate estimates;
* **all at once** (per size): every device loading its own direct copy concurrently, i.e. the
  share of host bandwidth each device gets when nobody's host link is idle.

Beside each multipath figure sits the path simulator's prediction (:mod:`scaleup.simulator`,
built as :mod:`scaleup.predict` builds its predictions) for the same routes, chunk size,
window and policy priors:

* ``topology``: capacities from the backend's reported topology (nominal link rates);
* ``measured_links``: capacities from this run's solo measurements (each device's host link
  alone, each peer→target link alone, host memory = the all-at-once aggregate), so the gap
  between it and the measurement is the part of the model that does not compose;
* ``preset`` (with ``--preset NAME``): an :func:`xpu.topology.preset` at this device count,
  e.g. the README's published DGX H200 assumptions.

Every figure is the median of ``--repeats`` per-transfer wall times (issue to the host seeing
the data complete; one untimed warm-up first; destinations poisoned and devices synchronised
before each, outside the timing). GB/s = 10**9 bytes per second. Sources carry a
position-and-device-unique pattern, and after the timed repeats of every configuration the
destination is copied back and compared byte for byte with its source: a configuration that
fails the check reports no GB/s (``null``), is listed under ``mismatches``, and the command
exits 1. A table goes to stdout (stderr with ``--json``, which prints the JSON instead); with
``--out`` the JSON (machine, date, torch version, command, every figure) and a PNG go there.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

import xpu
from xpu.probe import load_cached, machine_name
from xpu.topology import Topology, preset
from xpu.units import parse_bytes

from .engine import TransferEngine
from .handles import Transfer, TransferError
from .multipath import MultiPathCopier
from .policy import SplitPolicy
from .routes import Route, discover_routes, expected_aggregate_GBps, max_min_rates, resource_capacities
from .simulator import PathSimulator

__all__ = ["run_bench", "verify_bytes", "fill_pattern", "auto_chunk", "main"]

KiB, MiB, GiB = 2**10, 2**20, 2**30
DEFAULT_SIZES = "64MiB,256MiB,1GiB"
#: Destinations (and the read-back buffer) are filled with this byte before every transfer, so
#: bytes a copier never wrote cannot pass as copied. The source pattern never contains a word
#: of it (see :func:`fill_pattern`).
POISON = 0x5A


# ---------------------------------------------------------------------------------- data
def fill_pattern(buf: torch.Tensor, salt: int) -> torch.Tensor:
    """Fill uint8 ``buf`` with a pattern unique per 8-byte position and per ``salt``; return it.

    Word ``i`` holds ``i + 1 + salt * 2**40``: a chunk written at the wrong offset, a chunk
    missing, or another device's data (another salt) all differ from the source. Words stay
    below ``2**56`` (top byte zero), so no word equals the poison word. A tail of fewer than 8
    bytes gets ``0xA5``.
    """
    n = buf.numel()
    words = n // 8
    if words:
        w = buf[:words * 8].view(torch.int64)
        torch.arange(1, words + 1, dtype=torch.int64, out=w)  # written in place: no 1 GiB temporary
        w.add_(int(salt) << 40)
    if n % 8:
        buf[words * 8:].fill_(0xA5)
    return buf


def verify_bytes(engine: TransferEngine, device: int, dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor) -> dict[str, Any]:
    """Copy device tensor ``dst`` back into host ``scratch`` and compare it byte for byte with ``src``.

    The read-back goes through the engine's device→host path, independent of the host→device
    routes under test; ``scratch`` is poisoned first so a read-back that moved nothing cannot
    pass on stale contents.

    Returns:
        ``{"ok": True}`` or ``{"ok": False, "bad_bytes": n, "first_bad_offset": i,
        "expected": byte, "got": byte}``.
    """
    n = src.numel()
    back = scratch[:n]
    back.fill_(POISON)
    engine.d2h(dst, out=back, device=device).synchronize()
    if torch.equal(back, src):
        return {"ok": True}
    bad = (back != src).nonzero()
    first = int(bad[0, 0]) if bad.numel() else -1
    return {"ok": False, "bad_bytes": int(bad.shape[0]), "first_bad_offset": first,
            "expected": int(src[first]) if first >= 0 else None, "got": int(back[first]) if first >= 0 else None}


def auto_chunk(size: int) -> int:
    """The copier's chunk for a transfer of ``size``: at least 16 chunks, 64 KiB to 8 MiB, a power of two.

    A fixed 8 MiB chunk would give a 64 MiB transfer 8 chunks for 8 routes (one each: no room
    to learn or balance) and a 1 MiB smoke run a single chunk (no relay could carry a byte).
    """
    target = max(1, size // 16)
    return max(64 * KiB, min(8 * MiB, 1 << (target.bit_length() - 1)))


def _fmt_size(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def _gbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------- timing
def _sync_all(backend: xpu.Backend, devices: Sequence[int]) -> None:
    for d in devices:
        backend.synchronize(d)


def _time_transfers(backend: xpu.Backend, devices: Sequence[int], issue: Callable[[], list[Transfer]],
                    poison: Callable[[], None], repeats: int, warmup: int = 1) -> tuple[list[float], list[list[Transfer]]]:
    """Per-repeat wall seconds from issuing ``issue()`` until every transfer it returned is done.

    Before each repeat the destinations are poisoned and ``devices`` synchronised, outside the
    timing, so every repeat starts from idle devices and must write every byte again.

    Returns:
        The timed repeats' seconds and their transfer handles (warm-up excluded).

    Raises:
        TransferError: a transfer failed.
    """
    times, handles = [], []
    for i in range(warmup + repeats):
        poison()
        _sync_all(backend, devices)
        t0 = time.perf_counter()
        issued = issue()
        for h in issued:
            h.synchronize()
        _sync_all(backend, devices)  # the host saw completion; nothing may still be landing
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            handles.append(issued)
    return times, handles


def _event_ms(backend: xpu.Backend, stream: Any, fn: Callable[[], None], repeats: int = 3, warmup: int = 1) -> float:
    """Median milliseconds of ``fn``'s work on ``stream``, timed with the backend's events."""
    times = []
    for i in range(warmup + repeats):
        start, end = backend.event(timing=True), backend.event(timing=True)
        with backend.use_stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _summary(times: Sequence[float], nbytes: int, check: dict[str, Any]) -> dict[str, Any]:
    """GB/s of the median time, unless the bytes were wrong: then no number at all."""
    med = statistics.median(times)
    return {"GBps": _gbps(nbytes, med) if check["ok"] else None,
            "best_GBps": _gbps(nbytes, min(times)) if check["ok"] else None,
            "median_s": round(med, 6), "min_s": round(min(times), 6),
            "times_s": [round(t, 6) for t in times], "verified": check}


def _ratio(base: Mapping[str, Any] | None, faster: Mapping[str, Any]) -> float | None:
    """``base`` time over ``faster`` time, or None if either has no (verified) figure."""
    if not base or base.get("GBps") is None or faster.get("GBps") is None:
        return None
    return round(base["median_s"] / faster["median_s"], 3)


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"GBps": None, "best_GBps": None, "error": f"{type(exc).__name__}: {exc}", "verified": {"ok": False, "error": str(exc)}}


# ---------------------------------------------------------------------------------- routes and predictions
def _routes(backend: xpu.Backend, topo: Topology, target: int) -> list[Route]:
    """The routes the copier would discover by itself (peers only with peer access)."""
    if backend.caps.peer_access:
        return discover_routes(topo, target, backend=backend)
    return discover_routes(topo, target, peers=[])


def _measure_links(backend: xpu.Backend, targets: Sequence[int], nbytes: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each link alone, raw ``backend.copy`` timed with events: every device's host link, and
    every peer→target link the copier may relay over. These calibrate the ``measured_links``
    prediction."""
    b, n = backend, backend.device_count()
    progress(f"solo links ({_fmt_size(nbytes)} each)")
    src = b.host_arena.empty(nbytes)
    src.fill_(1)
    h2d: dict[str, float] = {}
    for d in range(n):
        dst, s = b.empty(nbytes, torch.uint8, d), b.stream(d)
        h2d[str(d)] = _gbps(nbytes, _event_ms(b, s, lambda: b.copy(dst, src, s)) / 1e3)
        del dst
    b.host_arena.release(src)
    peer: dict[str, float] = {}
    if b.caps.peer_access:
        for t in targets:
            for p in range(n):
                if p == t or not b.can_access_peer(p, t) or not b.enable_peer_access(p, t):
                    continue
                with b.device_scope(p):  # torch issues a peer copy from the source device
                    a, s = b.empty(nbytes, torch.uint8, p), b.stream(p)
                c = b.empty(nbytes, torch.uint8, t)
                with b.device_scope(p):
                    peer[f"{p}->{t}"] = _gbps(nbytes, _event_ms(b, s, lambda: b.copy(c, a, s)) / 1e3)
                del a, c
    return {"size_bytes": nbytes, "h2d_GBps": h2d, "peer_GBps": peer}


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
    """The simulator's multipath transfer into ``target`` on ``topo``, as :mod:`scaleup.predict` builds it.

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


# ---------------------------------------------------------------------------------- the benchmark
def run_bench(backend: xpu.Backend, sizes: Sequence[int], targets: Sequence[int], *, repeats: int = 5,
              chunk_bytes: int | None = None, window: int = 2, probe: Mapping[str, Any] | str | None = "auto",
              preset_name: str | None = None, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Measure direct, multipath and all-at-once loading for every target and size; return a JSON-ready dict.

    Args:
        backend: the backend to measure.
        sizes: transfer sizes in bytes.
        targets: device indices to load.
        repeats: timed repeats per figure (median reported), after one warm-up.
        chunk_bytes: the copier's chunk (None: :func:`auto_chunk` per size).
        window: the copier's chunks in flight per route.
        probe: the copier's priors: ``"auto"`` (cached ``xpu probe`` of this machine), a dict, or None.
        preset_name: also predict with this :func:`xpu.topology.preset` at this device count.
        progress: called with a short message before each step.

    Returns:
        ``{"rows": [...], "concurrent": [...], "links_measured": {...}, "mismatches": [...], "ok": bool}``.
    """
    b = backend
    n = b.device_count()
    targets = [b.index_of(t) for t in targets]
    all_devices = list(range(n))
    topo = b.topology()
    if probe == "auto":
        probe = load_cached(b)
    links = _measure_links(b, targets, min(max(sizes), 256 * MiB), progress)
    rows: list[dict[str, Any]] = []
    concurrent: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    arena = b.host_arena

    def record(where: dict[str, Any], what: str, key: dict[str, Any]) -> None:
        if not where["verified"].get("ok"):
            mismatches.append({**key, "config": what, **where["verified"]})

    with TransferEngine(b) as engine:
        for size in sizes:
            # One source per device, each with its own salt: all-at-once copies that land on the
            # wrong device fail the check too.
            srcs = [fill_pattern(arena.empty(size), salt=d + 1) for d in all_devices]
            scratch = arena.empty(size)
            dsts = [b.empty(size, torch.uint8, d) for d in all_devices]
            chunk = chunk_bytes or auto_chunk(size)
            for t in targets:
                key = {"target": t, "size_bytes": size}
                routes = _routes(b, topo, t)
                src, dst = srcs[t], dsts[t]
                row: dict[str, Any] = {"target": t, "size_bytes": size, "size": _fmt_size(size), "chunk_bytes": chunk,
                                       "window": window, "routes": [r.name for r in routes]}

                def poison() -> None:
                    dst.fill_(POISON)

                progress(f"target {t}, {_fmt_size(size)}: direct (engine)")
                try:
                    times, _ = _time_transfers(b, [t], lambda: [engine.h2d(src, device=t, out=dst)], poison, repeats)
                    row["direct"] = _summary(times, size, verify_bytes(engine, t, dst, src, scratch))
                except TransferError as exc:
                    row["direct"] = _failed(exc)
                record(row["direct"], "direct", key)

                progress(f"target {t}, {_fmt_size(size)}: direct (copier, 1 route)")
                direct_routes = [r for r in routes if r.via is None]
                if direct_routes:
                    copier = MultiPathCopier(b, t, routes=direct_routes, chunk_bytes=chunk, window=window, probe=probe)
                    try:
                        times, _ = _time_transfers(b, [t], lambda: [copier.h2d(src, out=dst)], poison, repeats)
                        row["copier_direct"] = _summary(times, size, verify_bytes(engine, t, dst, src, scratch))
                    except TransferError as exc:
                        row["copier_direct"] = _failed(exc)
                    finally:
                        copier.close()
                    record(row["copier_direct"], "copier_direct", key)

                progress(f"target {t}, {_fmt_size(size)}: multipath ({len(routes)} routes)")
                copier = MultiPathCopier(b, t, routes=routes, chunk_bytes=chunk, window=window, probe=probe)
                priors = {r.name: r.GBps for r in copier.routes}  # before any transfer teaches it
                mp: dict[str, Any] = {}
                try:
                    devices = sorted({t} | {r.via for r in routes if r.via is not None})
                    times, handles = _time_transfers(b, devices, lambda: [copier.h2d(src, out=dst)], poison, repeats)
                    mp = _summary(times, size, verify_bytes(engine, t, dst, src, scratch))
                    stats = [h[0].stats for h in handles]
                    mp["bytes_per_route"] = stats[-1]["bytes_per_route"]  # the last timed transfer
                    mp["chunks_per_route"] = stats[-1]["chunks_per_route"]
                    mp["bytes_per_route_all_repeats"] = {r: sum(s["bytes_per_route"][r] for s in stats) for r in priors}
                    mp["dropped"] = {k: v for s in stats for k, v in s["dropped"].items()}
                except TransferError as exc:
                    mp = _failed(exc)
                finally:  # what the policy learnt, even from a failed run
                    mp["priors_GBps"] = priors
                    mp["shares"] = {k: round(v, 4) for k, v in copier.policy.shares().items()}
                    mp["estimates_GBps"] = {k: round(v, 2) for k, v in copier.policy.estimates().items()}
                    mp["dropped_routes"] = copier.policy.dropped
                    copier.close()
                row["multipath"] = mp
                record(mp, "multipath", key)
                # Same bytes, so the speed-up is the ratio of median times (not of rounded GB/s).
                row["speedup"] = _ratio(row["direct"], mp)
                row["speedup_vs_copier_direct"] = _ratio(row.get("copier_direct"), mp)
                rows.append(row)

            progress(f"all {n} devices at once, {_fmt_size(size)} each")
            key = {"target": "all", "size_bytes": size}

            def poison_all() -> None:
                for d in all_devices:
                    dsts[d].fill_(POISON)

            def issue_all() -> list[Transfer]:
                # Pinned copies are queued straight from this thread, one per device's own copy
                # stream, so they run at once on an accelerator.
                return [engine.h2d(srcs[d], device=d, out=dsts[d]) for d in all_devices]

            try:
                times, _ = _time_transfers(b, all_devices, issue_all, poison_all, repeats)
                checks = {str(d): verify_bytes(engine, d, dsts[d], srcs[d], scratch) for d in all_devices}
                bad = {d: c for d, c in checks.items() if not c["ok"]}
                check = {"ok": not bad, **({"devices": bad} if bad else {})}
                summary = _summary(times, n * size, check)
                summary["aggregate_GBps"] = summary.pop("GBps")
                summary["per_device_GBps"] = round(summary["aggregate_GBps"] / n, 2) if summary["aggregate_GBps"] else None
            except TransferError as exc:
                summary = _failed(exc)
                summary["aggregate_GBps"] = summary["per_device_GBps"] = summary.pop("GBps")
            concurrent.append({"size_bytes": size, "size": _fmt_size(size), "devices": n,
                               "truly_concurrent": bool(b.caps.async_copy), **summary})
            record(summary, "all_at_once", key)
            for buf in srcs + [scratch]:
                arena.release(buf)
            del dsts
            arena.trim()  # the next size needs buffers of another size; do not hoard this one's

    # Predictions: cheap (a discrete-event model), so after the measurements, off the clock.
    progress("predictions")
    host_mem = max((c["aggregate_GBps"] or 0.0) for c in concurrent) if concurrent and n > 1 else None
    # name -> (topology, use the copier's routes and priors). A preset's routes are its own (it
    # may have peers this machine lacks); the other models use exactly what the copier had.
    models: dict[str, tuple[Topology, bool]] = {
        "topology": (topo, True),
        "measured_links": (calibrated_topology(topo, links, host_mem or None), True),
    }
    if preset_name:
        models["preset"] = (preset(preset_name, n), False)
    for row in rows:
        row["predicted"] = {
            name: predict_multipath(model, row["target"], row["size_bytes"], chunk_bytes=row["chunk_bytes"],
                                    window=row["window"], priors=row["multipath"].get("priors_GBps") if own else None,
                                    route_names=row["routes"] if own else None)
            for name, (model, own) in models.items()
        }
    conc_pred = {name: predict_concurrent(model) for name, (model, _) in models.items() if name != "measured_links"}
    for c in concurrent:
        c["predicted"] = conc_pred
    return {"links_measured": links, "rows": rows, "concurrent": concurrent, "mismatches": mismatches,
            "ok": not mismatches, "probe_used": probe is not None}


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
        line = (f"{r['target']:>6} {r['size']:>8} {_fmt_size(r['chunk_bytes']):>8} {_num(r['direct']['GBps']):>8} "
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
    lines.append(f"solo links ({_fmt_size(links['size_bytes'])}): host->d " + " ".join(f"{k}:{v:g}" for k, v in links["h2d_GBps"].items())
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


def _parse_targets(text: str, count: int) -> list[int]:
    if text.strip() == "all":
        return list(range(count))
    targets = [int(x) for x in text.split(",") if x.strip()]
    bad = [t for t in targets if not 0 <= t < count]
    if bad or not targets:
        raise ValueError(f"--targets {text!r}: devices are 0..{count - 1} (or 'all')")
    return targets


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (or the JSON); write JSON and PNG into ``--out``. Exit 1 on a byte mismatch."""
    parser = argparse.ArgumentParser(prog="python -m scaleup.bench_multipath", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated transfer sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--targets", default="0", help="comma-separated target devices, or 'all' (default 0)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure, median reported (default 5)")
    parser.add_argument("--chunk", default="auto", help="copier chunk size, or 'auto' (>= 16 chunks, 64 KiB..8 MiB)")
    parser.add_argument("--window", type=int, default=2, help="copier chunks in flight per route (default 2)")
    parser.add_argument("--no-probe", action="store_true", help="start the copier from nominal rates, not the cached xpu probe")
    parser.add_argument("--preset", default=None, help="also predict with this topology preset (e.g. dgx-h200)")
    parser.add_argument("--out", default=None, help="folder for the JSON (and PNG); nothing is written without it")
    parser.add_argument("--json", action="store_true", help="print the result JSON on stdout (the table goes to stderr)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        parser.error(f"--sizes {args.sizes!r}: give positive sizes, e.g. 64MiB,256MiB")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    backend = xpu.get_backend()
    try:
        targets = _parse_targets(args.targets, backend.device_count())
    except ValueError as exc:
        parser.error(str(exc))
    chunk = None if args.chunk == "auto" else parse_bytes(args.chunk)
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    bench = run_bench(backend, sizes, targets, repeats=args.repeats, chunk_bytes=chunk, window=args.window,
                      probe=None if args.no_probe else "auto", preset_name=args.preset,
                      progress=lambda m: print(f"measuring {m} ...", file=sys.stderr, flush=True))
    result = {
        "what": "scaleup MultiPathCopier vs the direct route, and all devices loading at once, "
                "with the path simulator's prediction for the same routes",
        "machine": f"{machine_name(backend)} ({socket.gethostname()}, {platform.machine()})",
        "backend": backend.name,
        "device_count": backend.device_count(),
        "devices": [d.name for d in backend.topology().devices],
        "caps": backend.caps.as_dict(),
        "topology": backend.topology().to_dict(),
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "scaleup.bench_multipath"] + (sys.argv[1:] if argv is None else list(argv))),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "settings": {"sizes": sizes, "targets": targets, "repeats": args.repeats, "chunk": args.chunk,
                     "window": args.window, "probe": not args.no_probe},
        "preset": args.preset,
        "method": "median of per-transfer wall times (issue to completion seen on the host) after one warm-up; "
                  "destinations poisoned before each transfer; every configuration's bytes compared with its source",
        **bench,
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    table = format_table(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"scaleup-multipath-{backend.name}-{started.strftime('%Y%m%dT%H%M%SZ')}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
        print(f"wrote {stem.with_suffix('.json')}", file=sys.stderr)
        if not args.no_plot:
            try:
                plot(result, stem.with_suffix(".png"))
                print(f"wrote {stem.with_suffix('.png')}", file=sys.stderr)
            except ImportError:
                print("matplotlib is not installed: wrote the JSON only", file=sys.stderr)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(table)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
