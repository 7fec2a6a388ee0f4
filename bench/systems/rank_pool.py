"""A pool of persistent spawned rank processes behind one benchmarked system.

Some systems (``mpress``, ``memferry-dp``) do not train in the worker process: they start one
process per rank or pipeline stage, each on its own device and joined in a process group, and
drive them one training step per :meth:`~bench.systems.base.BenchSystem.step` call. This
module holds what those systems share, on both sides of the process boundary:

* :class:`RankPool` (worker side) spawns the processes (``torch.multiprocessing``, spawn start
  method), gives each a command queue and all of them one reply queue, waits for every rank's
  ``ready`` message, sends commands and gathers one reply per rank, and turns a rank's failure
  into an exception here: the root cause among the ranks' errors (an out-of-memory one first,
  re-raised as ``torch.OutOfMemoryError`` so the harness files the row as ``oom``, see
  ``bench.worker._classify``). :meth:`RankPool.close` stops the ranks politely, then by force.
* :class:`RankChannel` (rank side) is the rank's end of those queues: its rank, world size and
  rendezvous port, the commands to serve (ending on ``stop``, or when the worker has died),
  replies, and the error report the pool understands.

Protocol: a command is ``(kind, payload)``; a reply is ``(kind, rank, info)`` with ``info`` a
dict. A rank that fails sends ``("error", rank, {"type", "message", "traceback", "oom"})``.
"""
from __future__ import annotations

import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.multiprocessing as mp

from xpu.dist import init_local_group, release_rendezvous, rendezvous_port

__all__ = ["RankPool", "RankChannel", "rank_env", "split_batch", "mean_loss", "peaks_text", "DataParallelRows"]

#: The command that ends a rank's command loop.
_STOP = "stop"


def rank_env(name: str, backend: Any, ranks: int, batch: int) -> dict[str, str]:
    """Check that ``ranks`` processes fit here and split ``batch``; their environment additions.

    Raises before any process starts: more ranks than devices, or a global batch that does
    not split into ``ranks`` equal micro-batches. The additions: virtual devices on the cpu
    backend (``Backend.env_for_device_count``), and the host budget split between the ranks (one host,
    so together their pinned arenas keep to the scenario's ``XPU_HOST_MEM_BUDGET``).
    """
    env: dict[str, str] = {}
    cpu_env = backend.env_for_device_count(max(ranks, backend.device_count()))
    if cpu_env is not None:
        env.update(cpu_env)
    elif backend.device_count() < ranks:
        raise ValueError(f"{name}: {ranks} ranks need {ranks} devices (one each); backend '{backend.name}' "
                         f"has {backend.device_count()} (lower option 'ranks')")
    if batch % ranks:
        raise ValueError(f"{name}: batch {batch} does not split into {ranks} equal micro-batches "
                         f"(the scenario's batch is the global batch; it must be a multiple of 'ranks')")
    budget = os.environ.get("XPU_HOST_MEM_BUDGET")
    if budget and budget.isdigit():
        env["XPU_HOST_MEM_BUDGET"] = str(int(budget) // ranks)
    return env


@dataclass
class RankChannel:
    """One rank's end of a :class:`RankPool` (picklable across the spawn: it holds the queues).

    Attributes:
        rank, world: this rank and the number of ranks.
        port: the process group's rendezvous id (:func:`xpu.dist.rendezvous_port`).
        name, noun: the system's name and what it calls a rank (``"stage"``, ``"rank"``), for messages.
        commands: this rank's command queue; replies: the queue every rank answers on.
        parent_pid: the worker's process id (a rank outliving it stops serving).
        env: environment additions, applied before the target runs.
        poll_s: how often an idle rank checks that the worker is still alive.
        orphaned: set when :meth:`commands` ended because the worker is gone rather than on ``stop``.
    """

    rank: int
    world: int
    port: int
    name: str
    noun: str
    commands: Any
    replies: Any
    parent_pid: int
    env: dict[str, str] = field(default_factory=dict)
    poll_s: float = 5.0
    orphaned: bool = False

    def reply(self, kind: str, info: dict[str, Any]) -> None:
        """Send ``info`` to the pool as this rank's ``kind`` reply (``ready``, ``step``, ...)."""
        self.replies.put((kind, self.rank, info))

    def serve(self) -> Iterator[tuple[str, Any]]:
        """The commands ``(kind, payload)`` sent to this rank, until ``stop`` or the worker's death.

        A worker killed from outside (e.g. by the harness's timeout) never sends ``stop``: an
        idle rank notices its parent is gone, sets :attr:`orphaned` and stops too, rather than
        linger holding a device. Its peers are likely gone as well, so a caller should skip any
        collective clean-up when :attr:`orphaned` is set.
        """
        while True:
            try:
                kind, payload = self.commands.get(timeout=self.poll_s)
            except queue.Empty:
                if os.getppid() != self.parent_pid:
                    self.orphaned = True
                    return
                continue
            if kind == _STOP:
                return
            yield kind, payload

    def fail(self, exc: BaseException, oom_types: tuple[type[BaseException], ...] = ()) -> None:
        """Report ``exc`` to the pool; out of memory when it is one of the OOM types or says so.

        ``oom_types`` adds the strategy's own out-of-memory errors (e.g. a planner that finds no
        plan under the cap) to ``torch.OutOfMemoryError`` and ``MemoryError``.
        """
        oom = isinstance(exc, (torch.OutOfMemoryError, MemoryError, *oom_types)) or \
            "out of memory" in str(exc).lower()
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.replies.put(("error", self.rank, {"type": type(exc).__name__, "message": str(exc)[:2000],
                                               "traceback": text[-4000:], "oom": oom}))

    def take_device(self, backend: Any) -> None:
        """Make device ``rank`` this process's current device for good (``backend.bind_process``):
        NCCL stages collective objects on the current device, and DeepSpeed reads it outside
        any device scope.

        Raises:
            ValueError: ``backend`` has fewer devices than ranks (each rank needs its own).
        """
        if backend.device_count() < self.world:
            raise ValueError(f"{self.world} {self.noun}s need {self.world} devices; backend '{backend.name}' has "
                             f"{backend.device_count()}")
        backend.bind_process(self.rank)

    def init_process_group(self, dist_backend: str, timeout_s: float) -> None:
        """Join the ranks' process group (file rendezvous :attr:`port`, see :func:`xpu.dist.init_local_group`).

        ``timeout_s`` bounds every collective: a rank that dies must not leave its peers
        waiting forever.
        """
        init_local_group(dist_backend, self.rank, self.world, self.port, timeout_s)

    @staticmethod
    def leave_process_group() -> None:
        """Destroy the process group if one was joined (never raises: this runs on the way out)."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _rank_entry(target: Callable[..., None], channel: RankChannel, args: tuple[Any, ...]) -> None:
    """Body of a spawned rank process: apply the environment additions, then run ``target``."""
    os.environ.update(channel.env)
    target(channel, *args)


class RankPool:
    """``ranks`` persistent spawned processes running ``target(channel, *args)``, one per rank.

    The constructor returns once every rank has answered ``ready``; their ready messages are in
    :attr:`ready`. On any failure during start-up the pool closes itself before raising.

    Args:
        name: the system's name, first word of every message (``"mpress"``).
        noun: what the system calls a rank (``"stage"``, ``"rank"``); processes are named
            ``f"{name}-{noun}{rank}"``.
        ranks: how many processes.
        target: a module-level function (the spawn pickles it by name) taking a
            :class:`RankChannel` and ``args``; it replies ``ready`` once set up, then serves
            :meth:`RankChannel.serve`, and reports any exception with :meth:`RankChannel.fail`.
        args: the target's further arguments (picklable).
        env: environment additions for the rank processes.
        setup_timeout_s: how long to wait for every rank's ``ready``.

    Raises:
        RuntimeError: a rank failed or died during set-up, or set-up took too long.
        torch.OutOfMemoryError: a rank ran out of memory during set-up.
    """

    #: Seconds close() waits for the ranks to stop after ``stop``, before terminating them.
    stop_grace_s = 15.0
    #: The same after a rank failed: its peers are stuck in a collective with it and will not stop.
    failed_grace_s = 1.0
    #: Seconds to gather the peers' errors after the first one (see :meth:`_root_cause`).
    error_gather_s = 3.0

    def __init__(self, name: str, noun: str, ranks: int, target: Callable[..., None], args: tuple[Any, ...] = (),
                 env: dict[str, str] | None = None, setup_timeout_s: float = 600.0) -> None:
        self.name, self.noun, self.ranks = name, noun, ranks
        self.failed = False
        self._procs: list[Any] = []
        mpctx = mp.get_context("spawn")
        self._commands: list[Any] = [mpctx.Queue() for _ in range(ranks)]
        self._replies: Any = mpctx.Queue()
        port = self._rendezvous = rendezvous_port()  # this pool reserved it and releases it at close
        try:
            for rank in range(ranks):
                channel = RankChannel(rank=rank, world=ranks, port=port, name=name, noun=noun,
                                      commands=self._commands[rank], replies=self._replies, parent_pid=os.getpid(),
                                      env=dict(env or {}))
                proc = mpctx.Process(target=_rank_entry, name=f"{name}-{noun}{rank}", daemon=True,
                                     args=(target, channel, args))
                proc.start()
                self._procs.append(proc)
            self.ready: dict[int, dict[str, Any]] = self.collect("ready", setup_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def processes(self) -> list[Any]:
        """The rank processes (empty once closed)."""
        return list(self._procs)

    def send(self, kind: str, payloads: Sequence[Any]) -> None:
        """Send command ``kind`` to every rank, ``payloads[rank]`` to rank ``rank``."""
        for q, payload in zip(self._commands, payloads, strict=True):
            q.put((kind, payload))

    def run(self, kind: str, payloads: Sequence[Any]) -> dict[int, dict[str, Any]]:
        """Send command ``kind`` to every rank and wait, without a time limit, for each one's ``kind`` reply."""
        self.send(kind, payloads)
        return self.collect(kind, None)

    def collect(self, kind: str, timeout_s: float | None) -> dict[int, dict[str, Any]]:
        """One ``kind`` reply from every rank, by rank.

        Raises:
            torch.OutOfMemoryError, RuntimeError: a rank reported an error (the root cause, see
                :meth:`_root_cause`), died without a word, answered something else, or the
                ranks did not all answer within ``timeout_s`` (None: no limit).
        """
        got: dict[int, dict[str, Any]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < self.ranks:
            try:
                msg_kind, rank, info = self._replies.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    self.failed = True
                    # A rank that died without a word (killed, e.g. by the host's OOM killer).
                    raise RuntimeError(f"{self.name}: {self.noun} process {dead[0].name} exited with code "
                                       f"{dead[0].exitcode} while waiting for '{kind}'")
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: {self.noun}s did not answer '{kind}' within {timeout_s:.0f} s")
                continue
            if msg_kind == "error":
                self.failed = True  # its peers are stuck in a collective with it: close() need not wait
                self._raise(*self._root_cause(rank, info))
            if msg_kind != kind:
                raise RuntimeError(f"{self.name}: {self.noun} {rank} answered {msg_kind!r}, expected {kind!r}")
            got[rank] = info
        return got

    def _root_cause(self, rank: int, info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The error to report: a rank's own failure (e.g. OOM) rather than a peer's broken collective.

        When one rank fails, its peers fail soon after in the collective (or send/recv) they
        were waiting in; collect the errors that arrive within a moment and prefer an
        out-of-memory one, then one with a message, then the lowest rank.
        """
        errors = {rank: info}
        deadline = time.monotonic() + self.error_gather_s
        while len(errors) < self.ranks and time.monotonic() < deadline:
            try:
                msg_kind, r, i = self._replies.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg_kind == "error":
                errors[r] = i
        return min(errors.items(), key=lambda kv: (not kv[1].get("oom"), not kv[1]["message"].strip(), kv[0]))

    def _raise(self, rank: int, info: dict[str, Any]) -> None:
        """Re-raise a rank's failure here, as ``torch.OutOfMemoryError`` when it was out of memory.

        The harness classifies a row by the exception type (``bench.worker._classify``): an OOM in
        a rank must reach it as an OOM, not as a RuntimeError carrying an OOM's text.
        """
        message = info["message"].strip() or "(no message; see the traceback)"
        text = f"{self.name} {self.noun} {rank}: {info['type']}: {message}\n{info['traceback']}"
        if info.get("oom"):
            raise torch.OutOfMemoryError(text)
        raise RuntimeError(text)

    def close(self) -> None:
        """Stop the rank processes (politely, then by force) and release the queues; idempotent."""
        for q, proc in zip(self._commands, self._procs):
            if proc.is_alive():
                try:
                    q.put((_STOP, None))
                except Exception:
                    pass
        deadline = time.monotonic() + (self.failed_grace_s if self.failed else self.stop_grace_s)
        for proc in self._procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._procs = []
        # Ranks stopped by force (or never joined) leave the rendezvous file behind: the pool owns it.
        release_rendezvous(self._rendezvous)
        for q in [*self._commands, *([self._replies] if self._replies is not None else [])]:
            q.close()
            q.cancel_join_thread()
        self._commands, self._replies = [], None


# ---------------------------------------------------------------------------------- data-parallel rows
def split_batch(inputs: torch.Tensor, targets: torch.Tensor, ranks: int, micro_batch: int,
                accumulation: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``r``'s rows ``r*b .. (r+1)*b-1`` of the global batch, on the host, one per rank.

    With ``accumulation`` N > 1 the step holds N global micro-batches of ``ranks * b`` rows one
    after another; rank ``r`` gets its ``b`` rows of each, in order (``N * b`` rows: its own N
    micro-batches). Each slice is cloned so it crosses the queue as its own small storage, not
    the whole batch's.
    """
    host_in, host_tgt = inputs.detach().to("cpu"), targets.detach().to("cpu")
    b = micro_batch

    def rows(t: torch.Tensor, r: int) -> torch.Tensor:
        return t.reshape(accumulation, ranks, b, *t.shape[1:])[:, r].reshape(accumulation * b, *t.shape[1:]).clone()

    return [(rows(host_in, r), rows(host_tgt, r)) for r in range(ranks)]


def mean_loss(replies: dict[int, dict[str, Any]], ranks: int) -> torch.Tensor:
    """The mean of the ranks' losses: with equal micro-batches, the mean loss over the whole batch."""
    return torch.tensor(sum(replies[r]["loss"] for r in range(ranks)) / ranks, dtype=torch.float32)


def peaks_text(peaks: Sequence[int | None]) -> str:
    """``"; peak device GB per rank: r0=… r1=…"`` (``?`` where unknown), or ``""`` when none is known."""
    if not any(p is not None for p in peaks):
        return ""
    return "; peak device GB per rank: " + " ".join(
        f"r{r}={p / 1e9:.4f}" if p is not None else f"r{r}=?" for r, p in enumerate(peaks))


class DataParallelRows:
    """Mixin for a system whose step splits the global batch over a :class:`RankPool`'s ranks.

    The system sets ``_pool``, ``ranks`` and ``_peaks`` (one entry per rank); each rank answers a
    ``("step", (inputs, targets))`` command with at least ``{"loss", "peak"}``.
    """

    _pool: RankPool
    ranks: int
    _peaks: list[int | None]

    @property
    def rank_peaks(self) -> list[int | None]:
        """Each rank's peak allocated device bytes (None: not tracked, or no step yet)."""
        return list(self._peaks)

    def _step_ranks(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int,
                    accumulation: int = 1) -> dict[int, dict[str, Any]]:
        """Send every rank its slice (of each micro-batch), gather the replies, record the peaks."""
        replies = self._pool.run("step", split_batch(inputs, targets, self.ranks, micro_batch, accumulation))
        for rank, info in replies.items():
            self._peaks[rank] = info["peak"]
        return replies
