"""Benchmark the multi-path copier against the direct route, with the simulator's prediction beside it.

    python -m bench.transfers.multipath --out bench/results/DIR --preset dgx-h200   # on a multi-GPU node
    XPU_BACKEND=cpu python -m bench.transfers.multipath --sizes 1MiB,4MiB --repeats 2   # smoke run

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
built as :mod:`bench.transfers.predict` builds its predictions) for the same routes, chunk size,
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

This module runs the measurements and the command line; :mod:`bench.transfers.multipath_measure`
holds the byte checks and timing, :mod:`bench.transfers.multipath_report` the predictions,
the table and the plot.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

import xpu
from xpu.probe import load_cached, machine_name
from xpu.topology import Topology, preset
from xpu.units import parse_bytes
from scaleup import MultiPathCopier, Route, Transfer, TransferEngine, TransferError, discover_routes

from .multipath_measure import (POISON, auto_chunk, failed, fill_pattern, fmt_size, measure_links, ratio, summarize,
                                time_transfers, verify_bytes)
from .multipath_report import calibrated_topology, format_table, plot, predict_concurrent, predict_multipath

__all__ = ["run_bench", "verify_bytes", "fill_pattern", "auto_chunk", "main"]

MiB = 2**20
DEFAULT_SIZES = "64MiB,256MiB,1GiB"


def _routes(backend: xpu.Backend, topo: Topology, target: int) -> list[Route]:
    """The routes the copier would discover by itself (peers only with peer access)."""
    if backend.caps.peer_access:
        return discover_routes(topo, target, backend=backend)
    return discover_routes(topo, target, peers=[])


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
    links = measure_links(b, targets, min(max(sizes), 256 * MiB), progress)
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
                row: dict[str, Any] = {"target": t, "size_bytes": size, "size": fmt_size(size), "chunk_bytes": chunk,
                                       "window": window, "routes": [r.name for r in routes]}

                def poison() -> None:
                    dst.fill_(POISON)

                progress(f"target {t}, {fmt_size(size)}: direct (engine)")
                try:
                    times, _ = time_transfers(b, [t], lambda: [engine.h2d(src, device=t, out=dst)], poison, repeats)
                    row["direct"] = summarize(times, size, verify_bytes(engine, t, dst, src, scratch))
                except TransferError as exc:
                    row["direct"] = failed(exc)
                record(row["direct"], "direct", key)

                progress(f"target {t}, {fmt_size(size)}: direct (copier, 1 route)")
                direct_routes = [r for r in routes if r.via is None]
                if direct_routes:
                    copier = MultiPathCopier(b, t, routes=direct_routes, chunk_bytes=chunk, window=window, probe=probe)
                    try:
                        times, _ = time_transfers(b, [t], lambda: [copier.h2d(src, out=dst)], poison, repeats)
                        row["copier_direct"] = summarize(times, size, verify_bytes(engine, t, dst, src, scratch))
                    except TransferError as exc:
                        row["copier_direct"] = failed(exc)
                    finally:
                        copier.close()
                    record(row["copier_direct"], "copier_direct", key)

                progress(f"target {t}, {fmt_size(size)}: multipath ({len(routes)} routes)")
                copier = MultiPathCopier(b, t, routes=routes, chunk_bytes=chunk, window=window, probe=probe)
                priors = {r.name: r.GBps for r in copier.routes}  # before any transfer teaches it
                mp: dict[str, Any] = {}
                try:
                    devices = sorted({t} | {r.via for r in routes if r.via is not None})
                    times, handles = time_transfers(b, devices, lambda: [copier.h2d(src, out=dst)], poison, repeats)
                    mp = summarize(times, size, verify_bytes(engine, t, dst, src, scratch))
                    stats = [h[0].stats for h in handles]
                    mp["bytes_per_route"] = stats[-1]["bytes_per_route"]  # the last timed transfer
                    mp["chunks_per_route"] = stats[-1]["chunks_per_route"]
                    mp["bytes_per_route_all_repeats"] = {r: sum(s["bytes_per_route"][r] for s in stats) for r in priors}
                    mp["dropped"] = {k: v for s in stats for k, v in s["dropped"].items()}
                except TransferError as exc:
                    mp = failed(exc)
                finally:  # what the policy learnt, even from a failed run
                    mp["priors_GBps"] = priors
                    mp["shares"] = {k: round(v, 4) for k, v in copier.policy.shares().items()}
                    mp["estimates_GBps"] = {k: round(v, 2) for k, v in copier.policy.estimates().items()}
                    mp["dropped_routes"] = copier.policy.dropped
                    copier.close()
                row["multipath"] = mp
                record(mp, "multipath", key)
                # Same bytes, so the speed-up is the ratio of median times (not of rounded GB/s).
                row["speedup"] = ratio(row["direct"], mp)
                row["speedup_vs_copier_direct"] = ratio(row.get("copier_direct"), mp)
                rows.append(row)

            progress(f"all {n} devices at once, {fmt_size(size)} each")
            key = {"target": "all", "size_bytes": size}

            def poison_all() -> None:
                for d in all_devices:
                    dsts[d].fill_(POISON)

            def issue_all() -> list[Transfer]:
                # Pinned copies are queued straight from this thread, one per device's own copy
                # stream, so they run at once on an accelerator.
                return [engine.h2d(srcs[d], device=d, out=dsts[d]) for d in all_devices]

            try:
                times, _ = time_transfers(b, all_devices, issue_all, poison_all, repeats)
                checks = {str(d): verify_bytes(engine, d, dsts[d], srcs[d], scratch) for d in all_devices}
                bad = {d: c for d, c in checks.items() if not c["ok"]}
                check = {"ok": not bad, **({"devices": bad} if bad else {})}
                summary = summarize(times, n * size, check)
                summary["aggregate_GBps"] = summary.pop("GBps")
                summary["per_device_GBps"] = round(summary["aggregate_GBps"] / n, 2) if summary["aggregate_GBps"] else None
            except TransferError as exc:
                summary = failed(exc)
                summary["aggregate_GBps"] = summary["per_device_GBps"] = summary.pop("GBps")
            concurrent.append({"size_bytes": size, "size": fmt_size(size), "devices": n,
                               "truly_concurrent": bool(b.caps.async_copy), **summary})
            record(summary, "all_at_once", key)
            for buf in srcs + [scratch]:
                arena.release(buf)
            dsts = None  # freed now (poison_all and issue_all name it: rebound, not deleted)
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
    parser = argparse.ArgumentParser(prog="python -m bench.transfers.multipath", description=__doc__.splitlines()[0])
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
        "command": " ".join(["python", "-m", "bench.transfers.multipath"] + (sys.argv[1:] if argv is None else list(argv))),
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
