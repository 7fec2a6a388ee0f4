"""Run ONE system in this (fresh) process and report one JSON row.

    python -m bench.worker --spec SPEC.json --result ROW.json
    python -m bench.worker --describe          # machine and software facts, as JSON

The spec holds the scenario (``Scenario.to_dict()``), the system entry's label, and where
to write the timeline. The row is written to ``--result`` and printed as the last stdout
line, prefixed ``@@row ``. Progress goes to stderr as ``@@progress {json}`` lines.

Outcomes: ``ok``; ``oom`` (``torch.OutOfMemoryError``, an "out of memory" error from a
library, or host memory past the scenario's host cap); ``missing`` (a package that is not
installed, named in the reason); ``error`` (anything else, with the message and innermost
frames). The worker itself never raises.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .host_memory import HostMemoryMonitor

__all__ = ["run_spec", "describe", "main"]

ROW_PREFIX = "@@row "
PROGRESS_PREFIX = "@@progress "
_GB = 1e9


# ---------------------------------------------------------------------------------- describe
def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict[str, Any]:
    """Machine and software facts for the report (initialises the backend in this process)."""
    import torch

    import xpu
    from xpu.probe import machine_name

    backend = xpu.get_backend()
    topo = backend.topology()
    devices = [{"index": d.index, "name": d.name, "total_gb": round(d.total_bytes / _GB, 2)} for d in topo.devices]
    return {
        "machine": machine_name(backend),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host_mem_gb": round((_host_total_bytes() or 0) / _GB, 1),
        "backend": backend.name,
        "device_type": backend.device_type,
        "dist_backend": backend.dist_backend,
        "device_count": backend.device_count(),
        "devices": devices,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "accelerator_runtime": None if backend.caps.virtual_devices else getattr(torch.version, backend.device_type, None),
            "deepspeed": _version("deepspeed"),
            "transformers": _version("transformers"),
            "xpu-offload": getattr(xpu, "__version__", None),
            "git_commit": _git_commit(),
        },
    }


# ---------------------------------------------------------------------------------- one run
def _prepare_env(spec: dict[str, Any]) -> None:
    from xpu.dist import free_port

    # One-process distributed launch for FSDP2 and DeepSpeed (DeepSpeed needs all five).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    scen = spec["scenario"]
    for key, value in (scen.get("env") or {}).items():
        os.environ[key] = value  # before torch initialises the device (e.g. allocator settings)
    host_cap = scen.get("host_mem_gb")
    if host_cap:
        # Our strategies' pinned arena honours the same host budget.
        os.environ.setdefault("XPU_HOST_MEM_BUDGET", str(int(host_cap * _GB)))
    cap = spec.get("device_mem_gb")
    if cap:
        # The cpu backend's virtual device must be at least as large as the cap asked for.
        os.environ.setdefault("XPU_CPU_DEVICE_MEM", str(max(int(cap * _GB) + 1, 2 * 10**9)))
    os.environ.setdefault("XPU_CPU_DEVICES", "1")


def _time_clipped_apart(row: dict[str, Any], warmup: int, steps: int) -> None:
    """Where a system says which steps clipped (``row["clipped"]``, one flag per step run), add
    the mean of the timed steps that follow a clipped step and of the others:
    ``step_mean_after_clip_s`` and ``step_mean_after_no_clip_s`` (None where there is no such
    step), and ``after_clip_timed`` (how many). A clipped step's cost shows in the next one:
    MemFerry re-applies speculative host updates once the coefficient lands, after the step's
    backward, and the next forward waits for them.

    Where the row also has both predictions (``predicted_step_s``, ``predicted_after_clip_step_s``),
    ``predicted_at_firing_s`` mixes them as the timed steps fell: the prediction of those steps'
    mean, given which of them followed a clip (when a clip fires is the data's, not the plan's)."""
    flags, times = row.get("clipped"), row.get("step_times_s")
    if not flags or not times or len(flags) != len(times):
        return
    timed = [(flags[i - 1] if i else False, times[i]) for i in range(warmup, min(len(times), warmup + steps))]
    for key, want in (("step_mean_after_clip_s", True), ("step_mean_after_no_clip_s", False)):
        picked = [t for f, t in timed if f == want]
        row[key] = round(statistics.fmean(picked), 5) if picked else None
    after = row["after_clip_timed"] = sum(f for f, _ in timed)
    normal, fired = row.get("predicted_step_s"), row.get("predicted_after_clip_step_s")
    if timed and normal is not None and fired is not None:
        row["predicted_at_firing_s"] = ((len(timed) - after) * normal + after * fired) / len(timed)


def _classify(exc: BaseException, requires: tuple[str, ...]) -> tuple[str, str]:
    """(status, reason) for an exception raised while setting up or training."""
    import torch

    from .systems import format_exception

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", text.splitlines()[0][:500]
    if isinstance(exc, ModuleNotFoundError):
        package = (exc.name or "").split(".")[0] or "?"
        return "missing", f"package '{package}' is not installed ({text})"
    lowered = str(exc).lower()
    oom_words = ("out of memory", "cublas_status_alloc_failed", "failed to allocate")
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and any(w in lowered for w in oom_words)):
        return "oom", text.splitlines()[0][:500]
    return "error", format_exception(exc)[-3000:]


def _all_threads() -> dict[str, Any]:
    """Profiler arguments that record ops of every thread (a strategy's optimizer thread
    started before profiling included), where this torch has the option."""
    import torch

    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):  # older torch: only the profiling thread is recorded
        return {}


def _activities(backend: Any) -> list[Any]:
    from torch.profiler import ProfilerActivity, supported_activities

    acts = [ProfilerActivity.CPU]
    # ProfilerActivity names the accelerator kinds: CUDA, XPU, MTIA, HPU; Ascend goes through PrivateUse1.
    name = {"npu": "PrivateUse1"}.get(backend.device_type, backend.device_type.upper())
    act = getattr(ProfilerActivity, name, None)
    if not backend.caps.virtual_devices and act is not None and act in supported_activities():
        acts.append(act)
    return acts


def run_spec(spec: dict[str, Any], progress: Callable[[dict[str, Any]], None] | None = None,
             in_process: bool = False) -> dict[str, Any]:
    """Run the system of ``spec`` and return its row; never raises.

    Args:
        spec: ``{"scenario": dict, "label": str, "timeline_path": str|None, "raw_trace_path": str|None,
            "device_mem_gb": float|None (defaults to the scenario's / entry's)}``.
        progress: called with ``{"label", "step", "total"}`` after each step.
        in_process: run inside the caller's process (tests); host-cap overruns are then
            reported after the run instead of ending the process.
    """
    t_start = time.perf_counter()
    from .scenario import Scenario
    from .systems import get_system

    scenario = Scenario.from_dict(spec["scenario"])
    entry = scenario.entry(spec["label"])
    eff = scenario.effective(entry)
    if spec.get("device_mem_gb") is not None:
        eff["device_mem_gb"] = spec["device_mem_gb"]
    sys_spec = get_system(entry.name)
    row: dict[str, Any] = {
        "system": entry.label, "system_name": entry.name, "status": "error", "reason": None,
        "approximate": sys_spec.approximate, "options": entry.options, "family": scenario.family,
        "model": scenario.model_dims(), "params": None, "batch": scenario.batch, "seq": scenario.seq,
        "accumulation_steps": scenario.accumulation_steps,
        "dtype": None, "steps": eff["steps"], "warmup": eff["warmup"], "device_mem_gb": eff["device_mem_gb"],
        "host_mem_gb": scenario.host_mem_gb,
    }
    spec = {**spec, "device_mem_gb": eff["device_mem_gb"]}
    if not in_process:  # never change the environment of a caller's process
        _prepare_env(spec)
    host_cap = int(scenario.host_mem_gb * _GB) if scenario.host_mem_gb else None

    def host_exceeded(nbytes: int) -> None:
        row.update(status="oom", reason=f"host memory {nbytes / _GB:.2f} GB went past the host cap "
                                        f"{scenario.host_mem_gb} GB", peak_host_gb=round(nbytes / _GB, 3))
        _emit_row(row, spec.get("result_path"))
        os._exit(3)  # as a smaller host would: the run ends here

    # XPU_BENCH_HOST_SAMPLE_S: seconds between host-memory samples (0: none while training; the
    # peak then comes from ru_maxrss and a last sample), to check what sampling costs a system.
    interval = float(os.environ.get("XPU_BENCH_HOST_SAMPLE_S", "0.2"))
    monitor = HostMemoryMonitor(host_cap, None if in_process else host_exceeded, interval_s=interval)
    if interval > 0:
        monitor.start()
    backend = system = None
    dev = 0
    try:
        import torch

        import xpu
        from strategies.models import flops_per_token, param_count
        from xpu.gc_clock import FullCollections
        from xpu.stream_pools import describe
        from .systems import load_factory
        from .systems.base import DTYPES, SystemContext

        backend = xpu.get_backend()
        dims = scenario.model_dims()
        dtype_name = scenario.dtype
        if dtype_name == "auto":
            dtype_name = "fp32" if backend.caps.virtual_devices else "bf16"
        row["dtype"] = dtype_name
        row["params"] = param_count(scenario.family, **dims)
        if eff["device_mem_gb"]:
            backend.set_memory_cap(dev, int(eff["device_mem_gb"] * _GB))
        factory = load_factory(sys_spec)
        ctx = SystemContext(backend=backend, device_index=dev, family=scenario.family, dims=dims,
                            dtype=DTYPES[dtype_name], batch=scenario.batch, seq=scenario.seq,
                            optimizer=scenario.optimizer, options=entry.options, seed=scenario.seed,
                            accumulation_steps=scenario.accumulation_steps)
        backend.reset_peak_memory(dev)
        gen = torch.Generator().manual_seed(scenario.seed)
        vocab = _vocab(scenario)
        # One step's rows: accumulation_steps micro-batches of `batch` rows (the first is the batch
        # an accumulation-free run of the same seed sees).
        rows = scenario.batch * scenario.accumulation_steps
        tokens = torch.randint(0, vocab, (rows, scenario.seq + 1), generator=gen)
        torch.manual_seed(scenario.seed)
        with backend.device_scope(dev):
            inputs = backend.to_device(tokens[:, :-1].contiguous(), dev)
            targets = backend.to_device(tokens[:, 1:].contiguous(), dev)
            t0 = time.perf_counter()
            system = factory(ctx)
            backend.synchronize(dev)
            row["setup_s"] = round(time.perf_counter() - t0, 3)
            tracked = getattr(system, "tracks_device_memory", True)
            if tracked:  # setup's peak (a planner's profiling, a rehearsal) apart from the steps'
                stats = backend.memory_stats(dev)
                row["setup_peak_device_gb"] = stats.peak_allocated / _GB
                row["setup_peak_device_reserved_gb"] = stats.peak_reserved / _GB
                retries = stats.alloc_retries
                backend.reset_peak_memory(dev)
            times, losses = [], []
            with FullCollections() as collections:  # Python's full GC pauses, step by step (xpu/gc_clock.py)
                for i in range(eff["total_steps"]):
                    backend.synchronize(dev)
                    t0 = time.perf_counter()
                    loss = system.step(inputs, targets)
                    backend.synchronize(dev)
                    times.append(time.perf_counter() - t0)
                    collections.step_done()
                    losses.append(None if loss is None else float(loss))
                    if progress:
                        progress({"label": entry.label, "step": i + 1, "total": eff["total_steps"]})
            getattr(system, "wrap_up", lambda: None)()  # untimed: e.g. an export and its reload check (said in the notes)
            timed = times[eff["warmup"]:eff["warmup"] + eff["steps"]]
            row["step_times_s"] = [round(t, 5) for t in times]
            row["gc_full_ms_steps"] = [round(t * 1e3, 1) for t in collections.steps]
            row["step_s"] = statistics.median(timed)
            row["step_mean_s"] = statistics.fmean(timed)
            row["step_min_s"], row["step_max_s"] = min(timed), max(timed)
            row["losses"] = [None if x is None else round(x, 5) for x in losses]
            row["loss_step"] = eff["loss_after"]
            row["loss"] = losses[eff["loss_after"] - 1]
            tokens_per_step = rows * scenario.seq  # every micro-batch of the step
            row["tokens_per_s"] = tokens_per_step / row["step_s"]
            fpt = flops_per_token(scenario.family, **dims)
            row["flops_per_token"] = fpt
            row["tflops"] = fpt * row["tokens_per_s"] / 1e12
            if all(x is None for x in losses):  # one part of a step timed alone: no training throughput
                row["tokens_per_s"] = row["tflops"] = None
            stats = backend.memory_stats(dev)
            row["peak_device_gb"] = stats.peak_allocated / _GB if tracked else None
            row["peak_device_reserved_gb"] = stats.peak_reserved / _GB if tracked else None
            if tracked:  # the steps' allocations made only after the allocator freed its cache (stalls)
                row["alloc_retries"] = stats.alloc_retries - retries
                # Which stream's pool holds what the steps reserved beyond what they allocated.
                row["reserved_by_stream"] = describe(backend.reserved_by_stream(dev))
            row["notes"] = getattr(system, "notes", "")
            row.update(getattr(system, "metrics", None) or {})
            _time_clipped_apart(row, eff["warmup"], eff["steps"])
            row["status"] = "ok"
            if spec.get("timeline_path") and scenario.timeline:
                _profile_step(backend, dev, system, inputs, targets, spec, row)
    except BaseException as exc:  # the worker reports every outcome as a row
        if isinstance(exc, KeyboardInterrupt):
            raise
        row["status"], row["reason"] = _classify(exc, sys_spec.requires)
        # A system whose memory this process cannot see (stages in other processes) gets no figure.
        if backend is not None and row.get("peak_device_gb") is None and getattr(system, "tracks_device_memory", True):
            try:
                stats = backend.memory_stats(dev)
                row["peak_device_gb"] = stats.peak_allocated / _GB
                row["peak_device_reserved_gb"] = stats.peak_reserved / _GB
            except Exception:
                pass
    finally:
        if system is not None:
            try:
                system.close()
            except Exception:
                pass
        if in_process:
            # Free this run's tensors now (autograd graphs hold cycles), so the next
            # in-process run starts from an empty device, then lift the cap.
            import gc

            system = None
            gc.collect()
            if backend is not None and eff["device_mem_gb"]:
                backend.set_memory_cap(dev, None)
        peak_host = monitor.stop()
        row["peak_host_gb"] = round(peak_host / _GB, 3)
        if host_cap is not None and peak_host > host_cap and row["status"] == "ok":
            row["status"] = "oom"
            row["reason"] = f"host memory peaked at {peak_host / _GB:.2f} GB, past the host cap {scenario.host_mem_gb} GB"
        row["wall_s"] = round(time.perf_counter() - t_start, 2)
    return _rounded(row)


def _vocab(scenario: Any) -> int:
    from strategies.models.hf_config import hf_config_dict

    if scenario.family == "hf":  # config as given, or a local folder's config.json
        return int(hf_config_dict(scenario.model).get("vocab_size", 32000))
    return int(scenario.model["vocab"])


def _profile_step(backend: Any, dev: int, system: Any, inputs: Any, targets: Any, spec: dict[str, Any],
                  row: dict[str, Any]) -> None:
    """Profile one more step and write its lanes timeline (and the raw trace if asked)."""
    import gzip
    import tempfile

    import torch

    from .report import timeline_lanes

    try:
        with torch.profiler.profile(activities=_activities(backend), **_all_threads()) as prof:
            backend.synchronize(dev)
            system.step(inputs, targets)
            system.finish()  # a host optimizer's updates belong to this step's timeline too
            backend.synchronize(dev)
        with tempfile.TemporaryDirectory() as tmp:
            raw_path = Path(tmp) / "raw.json"
            prof.export_chrome_trace(str(raw_path))
            raw = json.loads(raw_path.read_text())
        lanes = timeline_lanes(raw, label=row["system"], optimizer_on_host=getattr(system, "optimizer_on_host", False))
        path = Path(spec["timeline_path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(lanes))
        row["timeline"] = str(path)
        if spec.get("raw_trace_path"):
            raw_out = Path(spec["raw_trace_path"])
            with gzip.open(raw_out, "wt") as fh:
                json.dump(raw, fh)
            row["raw_trace"] = str(raw_out)
    except Exception as exc:  # a timeline is a by-product; its failure must not fail the row
        row["timeline_error"] = f"{type(exc).__name__}: {exc}"[:500]


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    for key in ("step_s", "step_mean_s", "step_min_s", "step_max_s"):
        if isinstance(row.get(key), float):
            row[key] = round(row[key], 5)
    for key in ("peak_device_gb", "peak_device_reserved_gb", "setup_peak_device_gb", "setup_peak_device_reserved_gb"):
        if isinstance(row.get(key), float):
            row[key] = round(row[key], 4)
    for key, nd in (("tokens_per_s", 1), ("tflops", 3), ("loss", 5)):
        if isinstance(row.get(key), float):
            row[key] = round(row[key], nd)
    return row


def _emit_row(row: dict[str, Any], result_path: str | None) -> None:
    text = json.dumps(row)
    if result_path:
        Path(result_path).write_text(text)
    sys.stdout.write("\n" + ROW_PREFIX + text + "\n")
    sys.stdout.flush()


def _emit_progress(info: dict[str, Any]) -> None:
    sys.stderr.write(PROGRESS_PREFIX + json.dumps(info) + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.worker``."""
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="JSON spec file (see run_spec)")
    parser.add_argument("--result", help="where to write the row as JSON")
    parser.add_argument("--describe", action="store_true", help="print machine and software facts as JSON")
    args = parser.parse_args(argv)
    if args.describe:
        info = describe()
        if args.result:
            Path(args.result).write_text(json.dumps(info))
        print(ROW_PREFIX + json.dumps(info))
        return 0
    if not args.spec:
        parser.error("--spec is required (or --describe)")
    spec = json.loads(Path(args.spec).read_text())
    spec["result_path"] = args.result
    row = run_spec(spec, progress=_emit_progress)
    _emit_row(row, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
