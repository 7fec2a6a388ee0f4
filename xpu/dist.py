"""What every multi-process part needs from ``torch.distributed``, written once: a rendezvous id,
a process group joined through it with a bounded timeout, and "the first rank decides".

MemFerry's data parallelism, MPress's stages and the harness's rank pools all start process
groups on one machine and all make one rank compute a plan the others must share; a rank that
fails must make every rank fail with its message, never leave the others waiting.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
from typing import Any, Callable, TypeVar

__all__ = ["HOST_LIBRARY", "p2p_library", "free_port", "rendezvous_port", "rendezvous_path", "release_rendezvous", "init_local_group",
           "decide_on_first_rank",
           "collective_timeout", "peer_failure", "leave_rank", "TIMEOUT_ENV"]

T = TypeVar("T")

#: Seconds that bound every collective of the groups our strategies make (default 300).
TIMEOUT_ENV = "XPU_COLLECTIVE_TIMEOUT_S"


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_path(port: int) -> str:
    """The file through which the ranks of the local group with rendezvous id ``port`` meet."""
    folder = os.path.join(tempfile.gettempdir(), f"xpu-rendezvous-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, str(port))


def rendezvous_port() -> int:
    """A rendezvous id for :func:`init_local_group`, its file reserved (created empty) now.

    A free loopback port, so it is unique among this machine's live groups like a TCP
    rendezvous was; the file is created exclusively, so an id whose file a crashed group left
    behind is skipped rather than read.
    """
    for _ in range(100):
        port = free_port()
        try:
            os.close(os.open(rendezvous_path(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            continue
        return port
    raise RuntimeError(f"no free rendezvous id: 100 tries found a file in {os.path.dirname(rendezvous_path(0))}; "
                       f"remove its stale files")


def release_rendezvous(port: int) -> None:
    """Remove the rendezvous file of ``port`` if it is still there (no-op when it is gone).

    torch removes it when every rank has left; ranks stopped by force or that never joined leave
    it behind, so whoever reserved the id (:func:`rendezvous_port`) releases it when done.
    """
    try:
        os.unlink(rendezvous_path(port))
    except FileNotFoundError:
        pass


#: The host collective library: it runs wherever torch.distributed does, on host tensors.
HOST_LIBRARY = "gloo"


def p2p_library(dist_backend: str, devices: list[int] | tuple[int, ...]) -> str:
    """The collective library for a group whose rank ``r`` runs on device ``devices[r]``.

    ``dist_backend`` (the backend's own, e.g. NCCL) when every rank has a device of its own;
    :data:`HOST_LIBRARY` when two ranks share one, which an accelerator's library refuses
    (NCCL: "Duplicate GPU detected"). Device tensors must then be staged through host memory
    to cross the group (gloo's send/recv take host tensors only).
    """
    return dist_backend if len(set(devices)) == len(devices) else HOST_LIBRARY


def init_local_group(dist_backend: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the default process group of ``world`` ranks on this machine, rendezvous id ``port``.

    The ranks meet through a file (:func:`rendezvous_path`; torch removes it when every rank has
    left), not a TCP store: torch's ``TCPStore`` listens on every interface (``[::]:port``)
    whatever host it is given, and a one-machine group has no business being reachable from
    the network. gloo's own pair sockets are put on the loopback interface too
    (``GLOO_SOCKET_IFNAME=lo`` unless set). ``port`` is best from :func:`rendezvous_port`.

    ``timeout_s`` bounds every collective of the group: a rank that dies or stops must not
    leave its peers waiting for torch's 30-minute default.
    """
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo otherwise binds the hostname's address
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(rendezvous_path(port), world)
    store.set_timeout(timeout)
    dist.init_process_group(dist_backend, rank=rank, world_size=world, store=store, timeout=timeout)


def decide_on_first_rank(decide: Callable[[], T], group: Any = None, *, what: str = "decide",
                         timeout: datetime.timedelta | None = None) -> T:
    """Run ``decide`` on the group's first rank and return its result on every rank.

    If ``decide`` raises there, every rank raises: the first rank its own exception, the others
    a ``RuntimeError`` naming the rank and the error, instead of waiting for a result that never
    comes. An exception ``decide`` returns (rather than raises) is raised on every rank as it is. Results travel over a gloo group made for the purpose (NCCL would need them staged
    on the device), bounded by ``timeout``.

    Args:
        decide: what the first rank computes; its result must pickle.
        group: the process group (None: the default group).
        what: what ``decide`` does, for the other ranks' message ("rank 0 could not WHAT: ...").
        timeout: the gloo group's timeout (None: the default group's).
    """
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == ranks[0]:
        try:
            box[0] = decide()
        except Exception as exc:
            failure, box[0] = exc, RuntimeError(f"rank {ranks[0]} could not {what}: {type(exc).__name__}: {exc}")
    objects = dist.new_group(ranks, backend="gloo", **({"timeout": timeout} if timeout is not None else {}))
    try:
        dist.broadcast_object_list(box, src=ranks[0], group=objects)
    finally:
        dist.destroy_process_group(objects)
    if failure is not None:
        raise failure
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


#: Fragments of the errors gloo, NCCL and HCCL raise when a peer stopped (a timeout) or died (a
#: closed connection). torch gives them no common type beyond ``torch.distributed.DistError``.
_PEER_FAILURE_SIGNS = ("timed out", "operation timeout", "connection closed", "connection reset", "broken pipe",
                       "connection refused")


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a peer process stopped answering or went away."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())) or any(s in str(exc).lower() for s in _PEER_FAILURE_SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def collective_timeout(default_s: float = 300.0) -> datetime.timedelta:
    """How long a collective of our own groups may wait: ``XPU_COLLECTIVE_TIMEOUT_S``, else ``default_s``.

    A rank that stopped or died must end its peers' waits with an error in bounded time, not
    after gloo's 30-minute default.

    Raises:
        ValueError: the variable is not a positive number of seconds (names the variable).
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return datetime.timedelta(seconds=default_s)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds (e.g. 300)")
    return datetime.timedelta(seconds=seconds)


def leave_rank(code: int) -> None:
    """End a rank's process with ``code`` at once, its output flushed, skipping interpreter shutdown.

    With its process group gone, a torch thread (the rendezvous store's, gloo's) can still be
    alive at shutdown, and destroying it aborts the process ("terminate called without an active
    exception", SIGABRT) after the rank's work is done: about one run in five for ``xpu mpress``'s
    refusal, and once in about 30 data-parallel ``xpu train`` runs on the cpu backend
    (2026-12-02). Call it only once everything the rank owns is closed and written.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
