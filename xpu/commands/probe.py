"""``xpu probe``: measure the machine and cache the figures for cost models."""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..probe import ProbeConfig, load_cached, run_probe, save_cached
from ..registry import get_backend
from ..units import parse_bytes


def _size(text: str) -> int:
    """A byte size for argparse (a bad one is a one-line usage error, exit 2)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu probe``."""
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--cached", action="store_true", help="print the cached result instead of measuring (error if none)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures to plan with")
    parser.add_argument("--size", type=_size, default=None, help="transfer size, e.g. 256MiB (default: 256MiB on an accelerator)")
    parser.add_argument("--host-size", type=_size, default=None,
                        help="each host-memory array, e.g. 512MiB (default: 512MiB on an accelerator; 0: skip the host "
                             "section)")
    parser.add_argument("--device", type=int, default=0, help="device to measure (default 0)")
    parser.add_argument("--matmul-m", default=None, help="comma list of M for the DHA matmul rows, e.g. 64,256,4096")


def run(args: argparse.Namespace) -> int:
    """Measure (or read the cache), save, print."""
    backend = get_backend()
    if args.cached:
        result = load_cached(backend)
        if result is None:
            raise SystemExit("xpu probe: no cached result for this machine yet; run `xpu probe` first")
    else:
        cfg = ProbeConfig.for_backend(backend, quick=args.quick)
        cfg.device = args.device
        if args.size:
            cfg.nbytes = args.size
        if args.host_size is not None:
            cfg.host_nbytes = args.host_size
        if args.matmul_m:
            cfg.matmul_ms = [int(m) for m in args.matmul_m.split(",")]
        console = Console(stderr=True)
        with console.status("probing") as status:
            result = run_probe(backend, cfg, progress=lambda msg: status.update(f"probing: {msg}"))
        result["cache_file"] = str(save_cached(backend, result))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_table(result)
    return 0


def _print_table(result: dict) -> None:
    console = Console()
    table = Table(title=f"xpu probe: {result['machine']} ({result['date']})")
    table.add_column("figure")
    table.add_column("GB/s", justify="right")
    for key, value in result.items():
        if key.endswith("_GBps") and not isinstance(value, dict):
            table.add_row(key.removesuffix("_GBps"), f"{value:.1f}")
    for pair, value in result.get("peer_GBps", {}).items():
        table.add_row(f"peer {pair}", f"{value:.1f}")
    console.print(table)
    mm = Table(title=f"matmul: {result.get('matmul_TFLOPs')} TFLOP/s on device; weight in host memory:")
    for col in ("M", "copy then matmul (ms)", "DHA (ms)", "DHA / copy"):
        mm.add_column(col, justify="right")
    for row in result.get("dha_matmul", []):
        mm.add_row(str(row["M"]), f"{row['copy_then_matmul_ms']:.3f}", f"{row.get('dha_ms', float('nan')):.3f}",
                   f"{row.get('dha_over_copy', float('nan')):.2f}")
    console.print(mm)
    host = result.get("host")
    if host:
        ht = Table(title=f"host memory, {host['threads']} threads, {host['array_bytes'] / 2**20:.0f} MiB arrays; "
                         f"transparent huge pages: {host.get('transparent_hugepages') or 'unknown'}")
        for col in ("figure", "alone", "beside h2d + d2h copies"):
            ht.add_column(col, justify="right")
        ht.add_row("triad (GB/s)", f"{host['triad_GBps']:.1f}", f"{host['triad_with_copies_GBps']:.1f}")
        ht.add_row("copy, read + write (GB/s)", f"{host['copy_GBps']:.1f}", "")
        ht.add_row("fused AdamW, fp32 (ns/param)", f"{host['adamw_ns_per_param']:.3f}",
                   f"{host['adamw_with_copies_ns_per_param']:.3f}")
        ht.add_row("the copies themselves (GB/s)", "", f"{host['copies_GBps']:.1f}")
        console.print(ht)
