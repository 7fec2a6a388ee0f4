"""Predict multi-path host→device bandwidth for 1, 2, 4 and 8 devices with the path simulator.

    python -m bench.transfers.predict --out bench/results

Writes ``scaleup-prediction.json`` (every figure, with the assumed link rates) and, when
matplotlib is installed, ``scaleup-prediction.png``. These are simulator predictions from
declared rates, not measurements. The scenario is one device loading while its peers' host
links are idle (e.g. one pipeline stage prefetching); if every device loads at once, each
host link is busy with its own traffic and relaying gains nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from xpu.topology import Topology, preset

from scaleup import PathSimulator, discover_routes, expected_aggregate_GBps, resource_capacities

__all__ = ["SCENARIOS", "predict", "main"]


def _dgx(n: int) -> Topology:
    return preset("dgx-h200", n)


def _dgx_two_sockets(n: int) -> Topology:
    topo = preset("dgx-h200", n)
    # GPUs 0-3 hang off socket 0, 4-7 off socket 1; host buffers live on socket 0, so relays
    # through GPUs 4-7 read across the inter-socket link.
    devices = tuple(replace(d, numa_node=0 if d.index < 4 else 1) for d in topo.devices)
    extra = {"numa_link_GBps": 120.0, "host_numa_node": 0}
    return Topology(devices, topo.links, topo.host_mem_GBps, topo.source + "+2-socket", extra)


def _cloudmatrix(n: int) -> Topology:
    return preset("cloudmatrix384", n)


def _cloudmatrix_shared_port(n: int) -> Topology:
    topo = preset("cloudmatrix384", n)
    # Host traffic rides the Unified Bus too: if a die's one UB port carries both host and
    # peer traffic, everything into the target shares that port.
    extra = {"port_kinds": ["ub"], "port_GBps": 196.0}
    return Topology(topo.devices, topo.links, topo.host_mem_GBps, topo.source + "+shared-ub-port", extra)


#: name -> (topology factory by device count, assumptions in words)
SCENARIOS: dict[str, tuple[Callable[[int], Topology], str]] = {
    "DGX H200 (PCIe Gen5 + NVSwitch)": (
        _dgx, "host link 55 GB/s per GPU (measured on our H200), NVSwitch 450 GB/s per GPU port, host memory 400 GB/s"),
    "DGX H200, host buffer on one of 2 sockets": (
        _dgx_two_sockets, "as above; GPUs 4-7 on the far socket, inter-socket link 120 GB/s (assumed)"),
    "CloudMatrix-style (UB links as declared)": (
        _cloudmatrix, "host link over UB 160 GB/s per die, die-to-die UB 196 GB/s, host memory 640 GB/s (vendor figures)"),
    "CloudMatrix-style, one UB port per die": (
        _cloudmatrix_shared_port, "as above, but host and peer traffic into a die share its 196 GB/s UB port (assumed)"),
}


def predict(counts: tuple[int, ...] = (1, 2, 4, 8), nbytes: int = 4 * 2**30, chunk_bytes: int = 16 * 2**20) -> dict[str, Any]:
    """Simulated GB/s into device 0 for each scenario and device count, with the assumptions."""
    out: dict[str, Any] = {
        "what": "SIMULATOR PREDICTION (not a measurement): host->device bandwidth into one device when it "
                "loads over its own host link plus relays through n-1 idle peers",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "bench.transfers.predict"] + sys.argv[1:]),
        "transfer_bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        "device_counts": list(counts),
        "scenarios": {},
    }
    for name, (factory, assumptions) in SCENARIOS.items():
        rows = []
        for n in counts:
            topo = factory(n)
            routes = discover_routes(topo, 0)
            caps = resource_capacities(topo)
            sim = PathSimulator(routes, caps, chunk_bytes=chunk_bytes).run(nbytes)
            steady, _ = expected_aggregate_GBps(routes, caps)
            direct = topo.host_link(0).GBps
            rows.append({"devices": n, "predicted_GBps": round(sim.GBps, 1), "steady_state_GBps": round(steady, 1),
                         "direct_link_GBps": direct, "gain": round(sim.GBps / direct, 2),
                         "chunks_per_route": sim.chunks_per_route})
        out["scenarios"][name] = {"assumptions": assumptions, "capacities_at_8": resource_capacities(factory(max(counts))),
                                  "rows": rows}
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """Draw predicted GB/s against device count (needs matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, scenario in data["scenarios"].items():
        xs = [r["devices"] for r in scenario["rows"]]
        ys = [r["predicted_GBps"] for r in scenario["rows"]]
        line, = ax.plot(xs, ys, marker="o", label=name)
        ax.plot(xs, [scenario["rows"][0]["direct_link_GBps"]] * len(xs), ls=":", color=line.get_color(), lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(data["device_counts"], [str(n) for n in data["device_counts"]])
    ax.set_xlabel("devices used (target + relaying peers)")
    ax.set_ylabel("host→device GB/s into one device")
    ax.set_title("PREDICTION (path simulator, declared link rates) — not measured\n"
                 "dotted: the target's own host link alone", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Write the prediction JSON (and PNG when matplotlib is available) into ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.transfers.predict", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results", help="output folder (default bench/results)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = predict()
    (out / "scaleup-prediction.json").write_text(json.dumps(data, indent=2))
    for name, scenario in data["scenarios"].items():
        print(f"{name}: " + ", ".join(f"{r['devices']}: {r['predicted_GBps']:g} GB/s (x{r['gain']:g})" for r in scenario["rows"]))
    try:
        plot(data, out / "scaleup-prediction.png")
    except ImportError:
        print("matplotlib is not installed: wrote the JSON only (pip install matplotlib for the plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
