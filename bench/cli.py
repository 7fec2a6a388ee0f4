"""``xpu bench``: run systems side by side on one model, batch and device-memory cap.

    xpu bench examples/bench/design-s3.yaml                 # every system of the scenario
    xpu bench design-s3 --systems torch,deepspeed-z2-offload --device-mem-gb 40
    xpu bench tiny --set model.layers=4 --set steps=3 --out /tmp/b
    xpu bench tiny --max-model --device-mem-gb 0.05 --host-mem-gb 8
    xpu bench qwen2-1.5b-finetune --min-cap --systems fsdp2-offload,deepspeed-z3-offload --cap-resolution 2
    xpu bench --list-systems

Each system runs in a fresh process; rows for missing packages, OOM and errors are written
and the run goes on. Outputs land in ``bench/results/<date>-<machine>/`` (or ``--out``).
This module imports nothing heavy at load time: the ``xpu`` CLI imports it for every command.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from xpu.cli import register_command

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``xpu bench``."""
    parser.add_argument("scenario", nargs="?", help="scenario YAML path, or a name in examples/bench/ (e.g. tiny, design-s3)")
    parser.add_argument("--systems", help="comma list of system labels or names to run (default: the scenario's)")
    parser.add_argument("--device-mem-gb", type=float, help="cap every system's device memory at this many GB (1e9 B)")
    parser.add_argument("--host-mem-gb", type=float, help="host-memory cap in GB (a run past it reads 'oom')")
    parser.add_argument("--steps", type=int, help="timed steps (median and mean over these)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up steps before the timed ones")
    parser.add_argument("--loss-after", type=int, help="report the loss after this many steps")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], help="compute dtype (auto: bf16 on a device, fp32 on cpu)")
    parser.add_argument("--timeout", type=float, help="per-system timeout in seconds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario value by dotted key, e.g. model.layers=4 (YAML value syntax); repeatable")
    parser.add_argument("--out", help="output folder (default bench/results/<date>-<machine>/)")
    parser.add_argument("--append", action="store_true",
                        help="merge into an existing results.json in --out (rows of other systems are kept)")
    parser.add_argument("--no-timeline", action="store_true", help="skip the profiled step and its timeline")
    parser.add_argument("--raw-trace", action="store_true", help="also keep each system's raw profiler trace (gzip)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--max-model", action="store_true", help="find, per system, the largest model that trains")
    parser.add_argument("--knob", choices=["layers", "hidden"], help="max-model: which dimension grows")
    parser.add_argument("--knob-range", metavar="LO:HI", help="max-model: search range of the knob, e.g. 1:256")
    parser.add_argument("--min-cap", action="store_true",
                        help="find, per system, the smallest device cap (GB) under which it trains the scenario")
    parser.add_argument("--cap-range", metavar="LO:HI",
                        help="min-cap: caps searched in GB, e.g. 4:48 (HI left out, e.g. 4: : the first trial runs uncapped)")
    parser.add_argument("--cap-resolution", type=float, metavar="GB",
                        help="min-cap: caps tried are LO + k * GB; the smallest is found to within it (default 1)")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                        help="merge results.json (max_model.json, min_cap.json) files of one scenario into --out (later "
                             "files win per system) and redo the report; min_cap.json rows merge with results.json ones")
    parser.add_argument("--list-systems", action="store_true", help="list registered systems and exit")
    parser.add_argument("--json", action="store_true", help="print the result JSON instead of the table")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from strategies.training.checks import parse_set_items
    from .scenario import ScenarioError

    out = parse_set_items(args.set, ScenarioError)
    simple = {"device_mem_gb": args.device_mem_gb, "host_mem_gb": args.host_mem_gb, "steps": args.steps,
              "warmup": args.warmup, "loss_after": args.loss_after, "dtype": args.dtype, "timeout_s": args.timeout,
              "max_model.knob": args.knob}
    out.update({k: v for k, v in simple.items() if v is not None})
    if args.cap_resolution is not None:
        out["min_cap.resolution"] = args.cap_resolution
    if args.cap_range:
        lo, sep, hi = args.cap_range.partition(":")
        try:
            out["min_cap.lo"], out["min_cap.hi"] = float(lo), (float(hi) if hi.strip() else None)
        except ValueError:
            sep = ""
        if not sep:
            raise ScenarioError(f"--cap-range takes LO:HI in GB (HI may be left out: uncapped), got {args.cap_range!r}")
    if args.knob_range:
        lo, sep, hi = args.knob_range.partition(":")
        try:
            out["max_model.lo"], out["max_model.hi"] = int(lo), int(hi)
        except ValueError:
            raise ScenarioError(f"--knob-range takes LO:HI integers, got {args.knob_range!r}") from None
    return out


def _check_search_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other: a one-line error before anything runs."""
    from .scenario import ScenarioError

    if args.min_cap and args.max_model:
        raise ScenarioError("--min-cap and --max-model are two searches; run one at a time")
    if not args.min_cap and (args.cap_range or args.cap_resolution is not None):
        raise ScenarioError("--cap-range and --cap-resolution set the --min-cap search; add --min-cap")
    if args.min_cap and args.device_mem_gb is not None:
        raise ScenarioError("--min-cap searches the device cap itself; drop --device-mem-gb (bound the search "
                            "with --cap-range LO:HI)")
    if args.min_cap and args.append:
        raise ScenarioError("--min-cap does not --append; run it again into the same --out to go on from its "
                            "trial journal, and --merge its min_cap.json with a results.json")


def _list_systems() -> int:
    from .systems import discovery_errors, missing_requirement, registered_systems

    for name, spec in registered_systems().items():
        missing = missing_requirement(spec)
        print(f"{name}{'  [approximate]' if spec.approximate else ''}{'  (missing: ' + missing + ')' if missing else ''}")
        print(f"    {spec.description}")
        if spec.options:
            print("    options: " + ", ".join(f"{k}={v!r}" for k, v in spec.options.items()))
    for err in discovery_errors():
        print(f"registration failed: {err}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Load and check the scenario (errors before anything runs), run it, print the table."""
    import json

    from .scenario import ScenarioError, load_scenario

    if args.list_systems:
        return _list_systems()
    if args.merge:
        from pathlib import Path

        from .report import merge_results

        if not args.out:
            raise ScenarioError("--merge needs --out (the folder to write the merged report to)")
        missing = [p for p in args.merge if not Path(p).exists()]
        if missing:
            raise ScenarioError(f"--merge: no such file(s): {', '.join(missing)}")
        try:
            result = merge_results([Path(p) for p in args.merge], Path(args.out))
        except ValueError as exc:
            raise ScenarioError(str(exc)) from None
        print(Path(result["outputs"]["markdown"]).read_text())
        return 0
    if not args.scenario:
        raise ScenarioError("give a scenario (a YAML path or a name in examples/bench/), or --list-systems")
    _check_search_flags(args)
    scenario = load_scenario(args.scenario, _overrides(args))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    if systems:
        scenario = scenario.select(systems)  # bad names fail here, before any worker starts
    command = "xpu bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["bench"] else \
        "xpu bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.max_model:
        from .maxmodel import run_max_model

        result = run_max_model(scenario, args.out, progress=not args.no_progress, command=command)
        stem = "max_model"
    elif args.min_cap:
        from .mincap import run_min_cap

        result = run_min_cap(scenario, args.out, progress=not args.no_progress, command=command)
        stem = "min_cap"
    else:
        from .runner import run_bench

        result = run_bench(scenario, args.out, append=args.append, timeline=False if args.no_timeline else None,
                           raw_trace=args.raw_trace, progress=not args.no_progress, command=command)
        stem = "results"
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        from pathlib import Path

        print(Path(result["outputs"]["markdown"]).read_text())
        print(f"written to {result['out_dir']}/ ({stem}.json, {stem}.md"
              + (", results.png" if result.get("plot") else "") + (", timelines/" if stem == "results" else "") + ")")
        if result.get("plot_skipped"):
            print(result["plot_skipped"])
    return 0


# `xpu <name>`: this module registers itself (the `xpu.commands` entry point in pyproject.toml names it).
register_command("bench", "bench.cli", "run systems side by side on one model and memory cap", order=18)
