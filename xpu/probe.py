"""Measure what the hardware really does, and cache it per machine for cost models.

Nominal link rates lie (PCIe drops generation at idle; pinned memory that is not DMA-registered
runs at pageable speed); planners use these measured figures instead. Every figure is the
median over repeats, timed with the backend's events on the stream that did the work.

GB/s here means 10**9 bytes per second. ``d2d_GBps`` counts bytes read plus bytes written
(a device copy touches memory twice); every other link rate counts bytes moved once. The
``host`` section (:func:`xpu.host_bandwidth.measure_host`) measures the host's own memory:
copy and triad on all cores, and torch's fused AdamW, alone and beside full-rate copies in
both directions (PCIe DMA and the CPU share that bandwidth).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .backend import Backend
from .host_bandwidth import measure_host
from .timing import median_event_seconds

__all__ = ["ProbeConfig", "run_probe", "cache_path", "load_cached", "save_cached", "machine_name"]


@dataclass
class ProbeConfig:
    """What to measure and how big.

    Attributes:
        nbytes: transfer size for the bandwidth figures.
        repeats: timed repeats per figure (median reported), after ``warmup`` untimed ones.
        matmul_dim: K = N of the DHA matmul weight (``dim x dim``).
        matmul_ms: values of M for DHA matmul against copy-then-matmul.
        dtype: matmul dtype.
        device: the device measured (peer and concurrent figures use all devices).
        host_nbytes: size of each of the host-memory section's four arrays (0: no section).
    """

    nbytes: int = 256 * 2**20
    repeats: int = 5
    warmup: int = 2
    matmul_dim: int = 8192
    matmul_ms: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])
    dtype: str = "bfloat16"
    device: int = 0
    host_nbytes: int = 512 * 2**20

    @classmethod
    def for_backend(cls, backend: Backend, quick: bool = False) -> "ProbeConfig":
        """Sizes that fit the device: full size on an accelerator, small on the cpu reference
        or with ``quick`` (a smoke run)."""
        if quick or not backend.caps.async_copy:
            return cls(nbytes=8 * 2**20, repeats=3, warmup=1, matmul_dim=256, matmul_ms=[16, 64, 256], dtype="float32",
                       host_nbytes=8 * 2**20)
        return cls()


def machine_name(backend: Backend) -> str:
    """A key for the machine *kind* (device model and count), stable across leases of it."""
    topo = backend.topology()
    names = sorted({d.name for d in topo.devices})
    return f"{backend.name}-{'+'.join(names)}-x{topo.device_count}".replace(" ", "_")


def cache_path(backend: Backend) -> Path:
    """Where probe results for this machine kind are cached (``XPU_CACHE_DIR`` overrides)."""
    root = os.environ.get("XPU_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "xpu")
    return Path(root) / f"probe-{machine_name(backend)}.json"


def load_cached(backend: Backend) -> dict[str, Any] | None:
    """The cached probe result for this machine kind, or None."""
    path = cache_path(backend)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def save_cached(backend: Backend, result: dict[str, Any]) -> Path:
    """Write ``result`` to :func:`cache_path` and return the path."""
    path = cache_path(backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


class _Timer:
    """Median milliseconds of a callable's work on a stream, timed by events."""

    def __init__(self, backend: Backend, cfg: ProbeConfig) -> None:
        self.backend, self.cfg = backend, cfg

    def ms(self, fn: Callable[[], None], stream: Any) -> float:
        return 1e3 * median_event_seconds(self.backend, stream, fn, repeats=self.cfg.repeats, warmup=self.cfg.warmup)


def _gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 2) if ms > 0 else float("inf")


def run_probe(backend: Backend, cfg: ProbeConfig | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure bandwidths and DHA matmul behaviour on ``backend``; return one flat dict.

    Keys: ``h2d_pinned_GBps``, ``d2h_pinned_GBps``, ``h2d_pageable_GBps``, ``d2h_pageable_GBps``,
    ``duplex_GBps``, ``d2d_GBps``, ``peer_GBps`` (per ordered pair), ``h2d_concurrent_GBps``
    (all devices at once, when several), ``dha_read_GBps``, ``dha_write_GBps`` (when
    ``caps.dha``), ``matmul_TFLOPs``, ``dha_matmul`` (rows of M, DHA ms, copy-then-matmul ms),
    ``host`` (host memory: :func:`~xpu.host_bandwidth.measure_host`'s keys; absent when
    ``cfg.host_nbytes`` is 0), plus ``machine``, ``backend``, ``date``, ``config``.
    """
    cfg = cfg or ProbeConfig.for_backend(backend)
    say = progress or (lambda _msg: None)
    b, dev, n = backend, cfg.device, cfg.nbytes
    timer = _Timer(b, cfg)
    arena = b.host_arena
    out: dict[str, Any] = {
        "machine": f"{machine_name(b)} ({socket.gethostname()}, {platform.machine()})",
        "backend": b.name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "config": asdict(cfg),
    }
    with b.device_scope(dev):
        s, s2 = b.stream(dev), b.stream(dev)
        pinned, pinned2 = arena.empty(n), arena.empty(n)
        pinned.fill_(1)
        pageable = torch.ones(n, dtype=torch.uint8)
        dbuf, dbuf2 = b.empty(n, torch.uint8, dev), b.empty(n, torch.uint8, dev)

        say("host->device, device->host")
        out["h2d_pinned_GBps"] = _gbps(n, timer.ms(lambda: b.copy(dbuf, pinned, s), s))
        out["d2h_pinned_GBps"] = _gbps(n, timer.ms(lambda: b.copy(pinned, dbuf, s), s))
        out["h2d_pageable_GBps"] = _gbps(n, timer.ms(lambda: b.copy(dbuf, pageable, s), s))
        out["d2h_pageable_GBps"] = _gbps(n, timer.ms(lambda: b.copy(pageable, dbuf, s), s))

        say("both directions at once")

        def duplex() -> None:
            ready = b.event()
            ready.record(s)
            s2.wait_event(ready)
            b.copy(dbuf, pinned, s)
            b.copy(pinned2, dbuf2, s2)
            done = b.event()
            done.record(s2)
            s.wait_event(done)

        out["duplex_GBps"] = _gbps(2 * n, timer.ms(duplex, s))

        say("device->device")
        out["d2d_GBps"] = _gbps(2 * n, timer.ms(lambda: b.copy(dbuf2, dbuf, s), s))
        dbuf2 = None  # free it before the DHA figures

        if b.caps.dha:
            say("direct host access")
            host_f = pinned.view(torch.float32)
            view = b.device_view(host_f, dev)
            dev_f = dbuf.view(torch.float32)
            with b.use_stream(s):
                out["dha_read_GBps"] = _gbps(n, timer.ms(lambda: torch.mul(view, 1.0, out=dev_f), s))
                out["dha_write_GBps"] = _gbps(n, timer.ms(lambda: torch.mul(dev_f, 1.0, out=view), s))
            view = None
        arena.release(pinned)
        arena.release(pinned2)
        dbuf = None

        out["peer_GBps"] = _peer_rates(b, cfg, timer, say)
        if b.device_count() > 1:
            out["h2d_concurrent_GBps"] = _concurrent_h2d(b, cfg, say)

        say("matmul")
        out.update(_matmul_figures(b, cfg, timer, s))
    if cfg.host_nbytes:
        out["host"] = measure_host(b, cfg.host_nbytes, cfg.repeats, cfg.warmup, dev, say)
    arena.trim()
    return out


def _peer_rates(b: Backend, cfg: ProbeConfig, timer: _Timer, say: Callable[[str], None]) -> dict[str, float]:
    rates: dict[str, float] = {}
    count = b.device_count()
    for src in range(count):
        for dst in range(count):
            if src == dst or not b.can_access_peer(src, dst):
                continue
            say(f"peer {src}->{dst}")
            b.enable_peer_access(src, dst)
            with b.device_scope(src):
                a = b.empty(cfg.nbytes, torch.uint8, src)
                s = b.stream(src)
            with b.device_scope(dst):
                c = b.empty(cfg.nbytes, torch.uint8, dst)
            with b.device_scope(src):
                rates[f"{src}->{dst}"] = _gbps(cfg.nbytes, timer.ms(lambda: b.copy(c, a, s), s))
            a = c = None  # free before the next pair
    return rates


def _concurrent_h2d(b: Backend, cfg: ProbeConfig, say: Callable[[str], None]) -> float:
    """Aggregate host->device rate with every device loading at once (shared host bandwidth)."""
    import time

    say("host->all devices at once")
    count = b.device_count()
    srcs = [b.host_arena.empty(cfg.nbytes) for _ in range(count)]
    dsts, streams = [], []
    for d in range(count):
        with b.device_scope(d):
            dsts.append(b.empty(cfg.nbytes, torch.uint8, d))
            streams.append(b.stream(d))
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        for d in range(count):
            b.synchronize(d)
        t0 = time.perf_counter()
        for d in range(count):
            with b.device_scope(d):
                b.copy(dsts[d], srcs[d], streams[d])
        for d in range(count):
            b.synchronize(d)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
    for buf in srcs:
        b.host_arena.release(buf)
    return _gbps(count * cfg.nbytes, statistics.median(times) * 1e3)


def _matmul_figures(b: Backend, cfg: ProbeConfig, timer: _Timer, s: Any) -> dict[str, Any]:
    dtype = getattr(torch, cfg.dtype)
    k = cfg.matmul_dim
    dev = cfg.device
    with b.device_scope(dev):
        w_host = b.host_arena.empty((k, k), dtype)
        w_host.copy_(torch.randn(k, k).to(dtype))
        w_dev = b.empty((k, k), dtype, dev)
        x_sq = b.to_device(torch.randn(k, k).to(dtype), dev)
        out: dict[str, Any] = {}
        with b.use_stream(s):
            ms = timer.ms(lambda: torch.mm(x_sq, w_dev), s)
        out["matmul_TFLOPs"] = round(2 * k**3 / (ms * 1e-3) / 1e12, 2)
        rows = []
        view = b.device_view(w_host, dev) if b.caps.dha else None
        for m in cfg.matmul_ms:
            x = x_sq[:m] if m <= k else b.to_device(torch.randn(m, k).to(dtype), dev)

            def copy_then_mm() -> None:
                b.copy(w_dev, w_host, s)
                torch.mm(x, w_dev)

            with b.use_stream(s):
                row = {"M": m, "copy_then_matmul_ms": round(timer.ms(copy_then_mm, s), 4)}
                if view is not None:
                    row["dha_ms"] = round(timer.ms(lambda: torch.mm(x, view), s), 4)
                    row["dha_over_copy"] = round(row["dha_ms"] / row["copy_then_matmul_ms"], 3)
            rows.append(row)
        out["dha_matmul"] = rows
        view = None
        b.host_arena.release(w_host)
    return out
