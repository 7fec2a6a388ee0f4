"""``xpu info``: the selected backend, its devices, memory, capabilities and topology."""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..registry import backend_status, get_backend
from ..units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu info``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def collect() -> dict:
    """Everything ``xpu info`` shows, as one JSON-friendly dict."""
    backend = get_backend()
    info = backend.describe()
    info["backends"] = backend_status()
    devices = []
    for d in backend.topology().devices:
        free, total = backend.mem_info(d.index)
        devices.append({"index": d.index, "name": d.name, "total_bytes": d.total_bytes, "free_bytes": free,
                        "cap_bytes": backend.memory_cap(d.index), "numa_node": d.numa_node})
    info["devices"] = devices
    info["topology"] = backend.topology().to_dict()
    return info


def run(args: argparse.Namespace) -> int:
    """Print the tables (or JSON)."""
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console = Console()
    head = Table(title=f"xpu backend: {info['backend']}", show_header=False)
    for key in ("device_type", "dist_backend", "visible_devices_env", "visible_devices", "device_count"):
        head.add_row(key, str(info[key]))
    for name, reason in info["backends"].items():
        head.add_row(f"backend {name}", "usable" if reason is None else f"not usable: {reason}")
    console.print(head)

    devs = Table(title="devices")
    for col in ("index", "name", "total", "free", "cap", "NUMA"):
        devs.add_column(col)
    for d in info["devices"]:
        devs.add_row(str(d["index"]), d["name"], format_bytes(d["total_bytes"]), format_bytes(d["free_bytes"]),
                     format_bytes(d["cap_bytes"]) if d["cap_bytes"] else "-", str(d["numa_node"] if d["numa_node"] is not None else "-"))
    console.print(devs)

    caps = Table(title="capabilities")
    caps.add_column("capability")
    caps.add_column("value")
    for key, value in info["caps"].items():
        caps.add_row(key, "yes" if value else "no")
    console.print(caps)

    links = Table(title=f"links (nominal, per direction; source: {info['topology']['source']})")
    for col in ("from", "to", "kind", "GB/s", "detail"):
        links.add_column(col)
    for link in info["topology"]["links"]:
        links.add_row(str(link["src"]), str(link["dst"]), link["kind"], f"{link['GBps']:g}", link["detail"])
    console.print(links)
    return 0
