"""The adaptive multi-path copier: one host→device transfer spread over several routes.

A transfer to device ``t`` is cut into chunks. A coordinator thread hands chunks to routes
(the direct host link, and host→peer→t relays) with :class:`~scaleup.policy.SplitPolicy`;
one worker thread per route queues each chunk's hops on that route's streams, keeps up to
``window`` chunks in flight, times every hop with events and reports the chunk's time (its
slowest hop, as hops of consecutive chunks overlap) back to the policy.

Relayed chunks land first in a staging buffer on the peer, taken from a bounded
:class:`~scaleup.pools.StagingPool`: the copier never holds more than ``peer_memory`` bytes of
any peer. Pageable sources are first packed into pinned host staging (also a bounded pool).

A route whose copy raises, or that makes no progress for ``stall timeout`` seconds, is
dropped; its unfinished chunks go back to the queue for the other routes, so the data still
arrives whole. A dropped route's worker checks before the hop that writes into the target
and gives its chunk up instead, so a late route does not write into memory handed back to
the caller. If every route is dropped the transfer fails with the reasons.

    copier = MultiPathCopier(backend, target=0, peer_memory="512MiB")
    t = copier.h2d(host_tensors)        # list -> list of tensors on device 0
    t.synchronize()
    print(t.stats["bytes_per_route"], copier.policy.shares())
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

import xpu
from xpu.topology import HOST
from xpu import in_host_memory
from xpu.units import parse_bytes

from .chunks import Chunk, TensorGroup, as_group, byte_view, device_outputs, make_chunks
from .handles import Transfer, TransferError
from .links import BackendLink
from .policy import SplitPolicy
from .pools import StagingPool
from .routes import Route, apply_probe, discover_routes

__all__ = ["MultiPathCopier", "RouteDropped"]

_STOP = object()


class RouteDropped(RuntimeError):
    """Raised inside a worker whose route was dropped while it held a chunk."""


@dataclass
class _Issued:
    chunk: Chunk
    timings: list[tuple[Any, Any]]
    held: list[tuple[StagingPool, torch.Tensor]]


@dataclass
class _RouteRunner:
    """Per-route streams and the worker thread for one transfer."""

    route: Route
    window: int
    streams: list[Any]
    aux: list[Any | None]
    inbox: queue.Queue = field(default_factory=queue.Queue)
    dead: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class MultiPathCopier:
    """Host→device copies to ``target`` split adaptively over every usable route.

    Args:
        backend: the :class:`xpu.Backend` (default ``xpu.get_backend()``).
        target: the device to load (default: current).
        routes: the routes to use (default: :func:`~scaleup.routes.discover_routes` over
            ``backend.topology()``, peers only where ``backend.can_access_peer``; only the
            direct route when ``caps.peer_access`` is false). Route hops may carry link
            models (the fault-injection point); hops without one use the backend's copy.
        chunk_bytes: chunk size.
        window: chunks in flight per route (2: double buffering).
        peer_memory: staging bytes each peer may lend (whole chunks; default ``window``
            chunks).
        host_staging: pinned host staging for pageable sources (default 2 chunks per route).
        probe: ``xpu probe`` figures for initial rates: a dict, ``"auto"`` (the cached
            probe of this machine, if any) or None (nominal topology rates).
        smoothing: weight of each new chunk time in a route's rate estimate.
        stall_timeout_s: least time without progress before a busy route is dropped.
        stall_factor: a route is also given this many times its expected chunk time.

    Raises:
        ValueError: bad sizes, routes to another device, duplicate routes, or no route.
    """

    def __init__(
        self,
        backend: xpu.Backend | None = None,
        target: Any = None,
        *,
        routes: Sequence[Route] | None = None,
        chunk_bytes: int | str = 8 * 2**20,
        window: int = 2,
        peer_memory: int | str | None = None,
        host_staging: int | str | None = None,
        probe: Mapping[str, Any] | str | None = "auto",
        smoothing: float = 0.5,
        stall_timeout_s: float = 2.0,
        stall_factor: float = 50.0,
    ) -> None:
        b = self.backend = backend or xpu.get_backend()
        self.target = b.index_of(target)
        self.chunk_bytes = parse_bytes(chunk_bytes)
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if stall_timeout_s <= 0 or stall_factor <= 0:
            raise ValueError("stall_timeout_s and stall_factor must be positive")
        peer_budget = parse_bytes(peer_memory) if peer_memory is not None else window * self.chunk_bytes
        if peer_budget < self.chunk_bytes:
            raise ValueError(f"peer_memory of {peer_budget} B is less than one chunk ({self.chunk_bytes} B); "
                             f"raise it or lower chunk_bytes")
        if routes is None:
            if b.caps.peer_access:
                routes = discover_routes(b.topology(), self.target, backend=b)
            else:
                routes = discover_routes(b.topology(), self.target, peers=[])
        routes = list(routes)
        if not routes:
            raise ValueError(f"no route from host memory to device {self.target}")
        names = [r.name for r in routes]
        if len(set(names)) != len(names):
            raise ValueError(f"routes must be distinct, got {names}")
        for r in routes:
            if r.target != self.target:
                raise ValueError(f"route {r.name} goes to device {r.target}, not to target {self.target}")
            if r.via is not None and not b.enable_peer_access(r.via, self.target):
                raise ValueError(f"route {r.name}: device {r.via} has no peer access to {self.target}")
        if probe == "auto":
            from xpu.probe import load_cached

            probe = load_cached(b)
        elif isinstance(probe, str):
            raise ValueError(f"probe must be a dict, 'auto' or None, got {probe!r}")
        self.routes = apply_probe(routes, probe)
        self.window = window
        self.stall_timeout_s, self.stall_factor = stall_timeout_s, stall_factor
        self.policy = SplitPolicy({r.name: r.GBps for r in self.routes}, smoothing=smoothing)
        self._default_link = BackendLink(b)
        # Bounded staging: one pool per relay peer (peer memory), one pinned host pool.
        self.pools: dict[int, StagingPool] = {
            r.via: StagingPool.on_device(b, r.via, self.chunk_bytes, peer_budget) for r in self.routes if r.via is not None
        }
        host_slots = (parse_bytes(host_staging) // self.chunk_bytes) if host_staging is not None else 2 * len(self.routes)
        if host_slots < 1:
            raise ValueError(f"host_staging of {host_staging} is less than one chunk ({self.chunk_bytes} B)")
        self.host_pool = StagingPool.on_host(b.host_arena, self.chunk_bytes, host_slots)
        for pool in self.pools.values():
            pool.reserve()  # allocate now: a first-use allocation inside a transfer would look like a stall
        # The staging buffers come from each peer's current-stream pool, where kernels queued
        # before may still use that memory: the route streams start after them (see _coordinate).
        self._reserved: list[Any] = []
        for peer in self.pools:
            with b.device_scope(peer):
                self._reserved.append(b.event())
                self._reserved[-1].record(b.current_stream(peer))
        self._streams: dict[str, tuple[list[Any], list[Any | None]]] = {}
        self._run_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ public
    def h2d(self, src: TensorGroup, *, out: TensorGroup | None = None) -> Transfer:
        """Copy host tensor(s) to the target over all live routes.

        Args:
            src: a contiguous host tensor or a list/tuple of them; pinned sources go straight
                onto the links, pageable ones through pinned host staging.
            out: target-device tensor(s) to fill (default: new ones).

        Returns:
            A :class:`~scaleup.handles.Transfer`; its ``stats`` has ``bytes_per_route``,
            ``chunks_per_route``, ``dropped`` (route → reason), ``seconds``, ``GBps``.

        Raises:
            TypeError, ValueError: bad input, before anything is queued.
        """
        if self._closed:
            raise RuntimeError("this MultiPathCopier is closed; make a new one")
        b = self.backend
        srcs, single = as_group(src, "src")
        for i, s in enumerate(srcs):
            if not in_host_memory(s):
                raise ValueError(f"src[{i}] is on {s.device}; the multi-path copier reads host memory")
        src_bytes = [byte_view(s, f"src[{i}]") for i, s in enumerate(srcs)]
        outs = device_outputs(b, srcs, out, self.target)
        dst_bytes = [byte_view(o, f"out[{i}]") for i, o in enumerate(outs)]
        chunks = make_chunks([(s, d, b.is_pinned(t)) for s, d, t in zip(src_bytes, dst_bytes, srcs)], self.chunk_bytes)
        transfer = Transfer(b, self.target, "h2d", outs[0] if single else outs, sum(s.numel() for s in src_bytes),
                            keep=srcs + outs)
        # The destination may still be read by compute queued before this call.
        with b.device_scope(self.target):
            fence = b.event()
            fence.record(b.current_stream(self.target))
        thread = threading.Thread(target=self._run, args=(transfer, chunks, fence), name="scaleup-multipath", daemon=True)
        transfer._threads.append(thread)
        thread.start()
        return transfer

    def copy(self, dst: TensorGroup, src: TensorGroup) -> Transfer:
        """``h2d(src, out=dst)``."""
        return self.h2d(src, out=dst)

    def close(self) -> None:
        """Wait for the running transfer, then free staging buffers."""
        with self._run_lock:
            self._closed = True
            for pool in self.pools.values():
                pool.close()
            self.host_pool.close()

    def __enter__(self) -> "MultiPathCopier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ coordinator
    def _streams_for(self, route: Route) -> tuple[list[Any], list[Any | None]]:
        # One stream per hop, on the device that drives it (the destination for host hops, the
        # source for peer hops, as torch issues device-to-device copies from the source), plus
        # an ingress stream on the destination of a peer hop: torch fences a cross-device copy
        # against the destination's current stream, which must not be the compute stream.
        if route.name not in self._streams:
            b = self.backend
            streams, aux = [], []
            for hop in route.hops:
                if hop.src == HOST:
                    streams.append(b.stream(hop.dst))
                    aux.append(None)
                else:
                    streams.append(b.stream(hop.src))
                    aux.append(b.stream(hop.dst))
            self._streams[route.name] = (streams, aux)
        return self._streams[route.name]

    def _run(self, transfer: Transfer, chunks: list[Chunk], fence: Any) -> None:
        with self._run_lock:
            try:
                self._coordinate(transfer, chunks, fence)
            except BaseException as exc:  # surfaced through the handle
                transfer._fail(exc)

    def _coordinate(self, transfer: Transfer, chunks: list[Chunk], fence: Any) -> None:
        policy = self.policy
        started = time.perf_counter()
        stats: dict[str, Any] = {
            "bytes_per_route": {r.name: 0 for r in self.routes},
            "chunks_per_route": {r.name: 0 for r in self.routes},
            "dropped": {},
            "chunks": len(chunks),
            "chunk_bytes": self.chunk_bytes,
        }
        history_start = len(policy.history)
        if not chunks:
            transfer.stats.update(stats, seconds=0.0, GBps=0.0, shares=policy.shares(), history=[])
            transfer._mark_finished()
            return
        reports: queue.Queue = queue.Queue()
        runners: dict[str, _RouteRunner] = {}
        for r in self.routes:
            if r.name in policy.dropped:
                continue
            window = self.window if r.via is None else min(self.window, self.pools[r.via].max_slots)
            streams, aux = self._streams_for(r)
            runner = _RouteRunner(r, window, streams, aux)
            for s in streams + [a for a in aux if a is not None]:
                for event in [fence] + self._reserved:
                    s.wait_event(event)
            runner.thread = threading.Thread(target=self._work, args=(runner, reports), name=f"scaleup-{r.name}", daemon=True)
            runner.thread.start()
            runners[r.name] = runner
        if not runners:
            raise TransferError(f"no live route to device {self.target}; dropped: {policy.dropped}")

        pending: deque[Chunk] = deque(chunks)
        inflight: dict[str, dict[int, Chunk]] = {name: {} for name in runners}
        last_progress: dict[str, float] = {}
        remaining = sum(c.nbytes for c in chunks)  # bytes not yet assigned
        completed = 0

        def drop(name: str, reason: str) -> None:
            nonlocal remaining
            runner = runners[name]
            runner.dead.set()
            policy.drop(name, reason)
            stats["dropped"][name] = reason
            # Its unfinished chunks go back to the front of the queue, in order.
            for chunk in sorted(inflight[name].values(), key=lambda c: c.index, reverse=True):
                chunk.owner = None
                pending.appendleft(chunk)
                remaining += chunk.nbytes
            inflight[name].clear()
            runner.inbox.put(_STOP)

        try:
            while completed < len(chunks):
                live = [n for n in runners if not runners[n].dead.is_set()]
                if not live:
                    reasons = "; ".join(f"{k}: {v}" for k, v in stats["dropped"].items())
                    raise TransferError(f"every route to device {self.target} failed, {len(chunks) - completed} of "
                                        f"{len(chunks)} chunks undelivered ({reasons})")
                while pending:
                    free = [n for n in live if len(inflight[n]) < runners[n].window]
                    backlog = {n: sum(c.nbytes for c in inflight[n].values()) for n in live}
                    name = policy.pick(free, backlog, remaining, pending[0].nbytes)
                    if name is None:
                        break
                    chunk = pending.popleft()
                    chunk.owner = name
                    remaining -= chunk.nbytes
                    if not inflight[name]:
                        last_progress[name] = time.perf_counter()
                    inflight[name][chunk.index] = chunk
                    runners[name].inbox.put(chunk)
                try:
                    kind, name, chunk, info = reports.get(timeout=min(0.05, self.stall_timeout_s / 4))
                except queue.Empty:
                    kind = None
                now = time.perf_counter()
                if kind is not None and chunk.owner == name and chunk.index in inflight.get(name, {}):
                    if kind == "done":
                        del inflight[name][chunk.index]
                        last_progress[name] = now
                        completed += 1
                        stats["bytes_per_route"][name] += chunk.nbytes
                        stats["chunks_per_route"][name] += 1
                        policy.observe(name, chunk.nbytes, info)
                    elif not runners[name].dead.is_set():
                        drop(name, f"copy failed: {info!r}")
                for name in live:
                    if inflight[name] and not runners[name].dead.is_set():
                        expected = self.chunk_bytes / (policy.estimate(name) * 1e9)
                        limit = max(self.stall_timeout_s, self.stall_factor * expected)
                        if now - last_progress[name] > limit:
                            drop(name, f"stalled: no chunk finished for {now - last_progress[name]:.2f} s (limit {limit:.2f} s)")
        finally:
            for runner in runners.values():
                runner.inbox.put(_STOP)
        for runner in runners.values():
            if not runner.dead.is_set() and runner.thread is not None:
                runner.thread.join()
        seconds = time.perf_counter() - started
        stats.update(seconds=seconds, GBps=transfer.nbytes / seconds / 1e9 if seconds > 0 else 0.0,
                     shares=policy.shares(), history=policy.history[history_start:],
                     pool_high_water={p: pool.high_water_bytes for p, pool in self.pools.items()},
                     pool_bound={p: pool.bound_bytes for p, pool in self.pools.items()})
        transfer.stats.update(stats)
        transfer._mark_finished()

    # ------------------------------------------------------------------ route worker
    def _work(self, runner: _RouteRunner, reports: queue.Queue) -> None:
        self.backend.bind_process(self.target)  # a new thread starts on device 0 (a context there, per process)
        pending: deque[_Issued] = deque()
        name = runner.route.name
        while True:
            try:
                item = runner.inbox.get(block=not pending)
            except queue.Empty:
                item = None
            if item is _STOP:
                if not runner.dead.is_set():
                    while pending:
                        self._complete(runner, pending.popleft(), reports)
                else:
                    # A dropped route's buffers go back only once its copies are seen finished;
                    # a copy still hanging keeps its buffer (the pool bound still holds).
                    for issued in pending:
                        if all(end.query() for _, end in issued.timings):
                            self._release(issued)
                return
            if item is not None:
                if runner.dead.is_set():
                    continue
                try:
                    pending.append(self._issue(runner, item, lambda: self._make_room(runner, pending, reports)))
                except BaseException as exc:
                    reports.put(("fail", name, item, exc))
                continue
            self._complete(runner, pending.popleft(), reports)

    def _make_room(self, runner: _RouteRunner, pending: deque, reports: queue.Queue) -> bool:
        """Finish this route's oldest chunk in flight, freeing its buffers; False if none."""
        if not pending:
            return False
        self._complete(runner, pending.popleft(), reports)
        return True

    def _take(self, pool: StagingPool, runner: _RouteRunner, make_room: Any) -> torch.Tensor:
        # Never wait for a buffer while holding buffers of chunks this worker could finish:
        # with pools shared between routes that would deadlock.
        while True:
            buf = pool.try_acquire()
            if buf is not None:
                return buf
            if not make_room():
                return pool.acquire(cancel=runner.dead)

    def _issue(self, runner: _RouteRunner, chunk: Chunk, make_room: Any = lambda: False) -> _Issued:
        b, route = self.backend, runner.route
        held: list[tuple[StagingPool, torch.Tensor]] = []
        timings: list[tuple[Any, Any]] = []
        try:
            src_buf = None  # None: read the chunk's own source segments
            if not chunk.pinned:
                buf = self._take(self.host_pool, runner, make_room)
                held.append((self.host_pool, buf))
                for seg in chunk.segments:
                    buf[seg.offset:seg.offset + seg.src.numel()].copy_(seg.src)
                src_buf = buf
            prev_end = None
            for i, hop in enumerate(route.hops):
                last = i == len(route.hops) - 1
                stream, aux = runner.streams[i], runner.aux[i]
                dst_buf = None
                if not last:
                    dst_buf = self._take(self.pools[hop.dst], runner, make_room)
                    held.append((self.pools[hop.dst], dst_buf))
                elif runner.dead.is_set():
                    raise RouteDropped(f"route {route.name} was dropped; not writing chunk {chunk.index} into the target")
                if prev_end is not None:
                    stream.wait_event(prev_end)
                start, end = b.event(timing=True), b.event(timing=True)
                model = hop.model or self._default_link
                with (b.use_stream(aux) if aux is not None else contextlib.nullcontext()):
                    start.record(stream)
                    for seg in chunk.segments:
                        n = seg.src.numel()
                        src = seg.src if src_buf is None else src_buf[seg.offset:seg.offset + n]
                        dst = seg.dst if dst_buf is None else dst_buf[seg.offset:seg.offset + n]
                        model.copy(dst, src, stream)
                    end.record(stream)
                timings.append((start, end))
                prev_end, src_buf = end, dst_buf
        except BaseException:
            self._release(_Issued(chunk, timings, held))
            raise
        return _Issued(chunk, timings, held)

    def _complete(self, runner: _RouteRunner, issued: _Issued, reports: queue.Queue) -> None:
        try:
            issued.timings[-1][1].synchronize()
            seconds = max(start.elapsed_time(end) for start, end in issued.timings) / 1e3
        except BaseException as exc:
            self._release(issued)
            reports.put(("fail", runner.route.name, issued.chunk, exc))
            return
        self._release(issued)
        reports.put(("done", runner.route.name, issued.chunk, seconds))

    @staticmethod
    def _release(issued: _Issued) -> None:
        # Only after the last hop finished (or never ran): the staging buffers are free to reuse.
        for pool, buf in issued.held:
            pool.release(buf)
        issued.held.clear()

