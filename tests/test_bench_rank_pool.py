"""`bench.systems.rank_pool`: spawned rank processes behind one benchmarked system (cpu backend, gloo).

The rank bodies below are module-level functions: the spawn start method pickles them by
name, so each rank process imports this module. Imports they do not need stay inside the tests.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import time

import pytest
import torch

from bench.systems.rank_pool import RankChannel, RankPool

#: The pool's processes are named "<name>-<noun><rank>": what the leak checks look for.
NAME = "pooltest"


def _echo(channel: RankChannel, factor: int) -> None:
    """Join a gloo group on the cpu backend, say ready, then answer each command with a sum over all ranks.

    Command ``die``: rank 1 exits without a word (as if killed), rank 0 answers.
    """
    import torch.distributed as dist

    import xpu

    try:
        channel.take_device(xpu.get_backend())
        channel.init_process_group("gloo", 30.0)
        channel.reply("ready", {"env": os.environ.get("POOLTEST_MARK")})
        for kind, payload in channel.serve():
            if kind == "die":
                if channel.rank == 1:
                    os._exit(3)
                channel.reply(kind, {})
                continue
            total = torch.tensor([float(payload)])
            dist.all_reduce(total)  # over the pool's rendezvous: every rank must have joined the same group
            channel.reply(kind, {"value": payload * factor, "total": float(total)})
    except BaseException as exc:
        channel.fail(exc)
    finally:
        channel.leave_process_group()


def _never_ready(channel: RankChannel) -> None:
    """Never say ready, nor read a command: only force ends it."""
    time.sleep(120)


def _fail(channel: RankChannel) -> None:
    """Rank 0 fails first like a peer on a broken connection; rank 1 then runs out of memory."""
    try:
        if channel.rank == 0:
            raise RuntimeError("Connection closed by peer")
        time.sleep(0.3)
        raise torch.OutOfMemoryError("tried to allocate 4 GiB: out of memory")
    except BaseException as exc:
        channel.fail(exc)


def _live_pool_processes() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith(f"{NAME}-")]


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    assert not _live_pool_processes()


def test_ranks_set_up_answer_commands_stop_politely_and_a_silent_death_is_reported():
    env = {"XPU_BACKEND": "cpu", "XPU_CPU_DEVICES": "2", "POOLTEST_MARK": "seen"}
    pool = RankPool(NAME, "rank", 2, _echo, args=(10,), env=env, setup_timeout_s=60)
    procs = pool.processes
    try:
        assert pool.ready == {0: {"env": "seen"}, 1: {"env": "seen"}}  # the environment additions reached the ranks
        assert [p.name for p in procs] == [f"{NAME}-rank0", f"{NAME}-rank1"]
        replies = pool.run("step", [1, 2])
        assert replies == {0: {"value": 10, "total": 3.0}, 1: {"value": 20, "total": 3.0}}
        assert pool.run("step", [5, 5])[1]["total"] == 10.0  # the ranks stay up between commands
        assert not pool.failed
        with pytest.raises(RuntimeError, match=rf"^{NAME}: rank process {NAME}-rank1 exited with code 3 "
                                               r"while waiting for 'die'$"):
            pool.run("die", [None, None])
        assert pool.failed
    finally:
        pool.close()
    assert [p.exitcode for p in procs] == [0, 3]  # rank 0 stopped on 'stop', not terminated
    assert pool.processes == []
    pool.close()  # closing twice is harmless


def test_ready_timeout_names_the_message_and_the_pool_terminates_its_ranks(monkeypatch):
    monkeypatch.setattr(RankPool, "stop_grace_s", 0.5)  # the default waits 15 s for a polite stop
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^{NAME}: stages did not answer 'ready' within 1 s$"):
        RankPool(NAME, "stage", 2, _never_ready, setup_timeout_s=1)
    # The ranks would sleep two minutes and never read 'stop': the failed constructor closed its own
    # pool by force (and _no_leftover_processes checks that none is left alive).
    assert time.monotonic() - t0 < 10


def test_root_cause_prefers_the_out_of_memory_error_and_the_harness_files_it_as_oom():
    from bench.worker import _classify

    with pytest.raises(torch.OutOfMemoryError) as info:
        RankPool(NAME, "rank", 2, _fail, setup_timeout_s=60)
    text = str(info.value)
    # Rank 0's error came first, but rank 1's out-of-memory is the cause worth reporting.
    assert text.startswith(f"{NAME} rank 1: OutOfMemoryError: tried to allocate 4 GiB: out of memory\n"), text
    assert "Traceback" in text  # the rank's traceback travels with it
    assert _classify(info.value, ())[0] == "oom"


def _channel(**kw) -> RankChannel:
    """A channel over plain in-process queues (for the rank side's logic without a process)."""
    base = dict(rank=1, world=2, port=0, name=NAME, noun="stage", commands=queue.Queue(), replies=queue.Queue(),
                parent_pid=os.getppid(), poll_s=0.05)
    return RankChannel(**{**base, **kw})


def test_serve_yields_commands_until_stop():
    ch = _channel()
    for item in [("step", 1), ("step", 2), ("stop", None), ("step", 3)]:
        ch.commands.put(item)
    assert list(ch.serve()) == [("step", 1), ("step", 2)]
    assert not ch.orphaned


def test_serve_ends_when_the_parent_is_gone():
    ch = _channel(parent_pid=-1)  # never anyone's parent: as if the worker had been killed
    assert list(ch.serve()) == []
    assert ch.orphaned


class _OwnOOM(Exception):
    """A strategy's own out-of-memory error (e.g. no plan fits the cap)."""


@pytest.mark.parametrize("exc, oom_types, oom", [
    (torch.OutOfMemoryError("x"), (), True),
    (MemoryError(), (), True),
    (RuntimeError("CUDA out of memory. Tried to allocate"), (), True),
    (_OwnOOM("no plan fits"), (_OwnOOM,), True),
    (_OwnOOM("no plan fits"), (), False),
    (ValueError("bad"), (), False),
])
def test_fail_reports_the_error_and_whether_it_is_out_of_memory(exc, oom_types, oom):
    ch = _channel()
    try:
        raise exc
    except BaseException as caught:
        ch.fail(caught, oom_types=oom_types)
    kind, rank, info = ch.replies.get_nowait()
    assert (kind, rank, info["oom"], info["type"]) == ("error", 1, oom, type(exc).__name__)
    assert info["traceback"].startswith("Traceback") and "raise exc" in info["traceback"]


def test_too_few_devices_are_refused_with_the_system_s_noun():
    class Backend:
        name = "cpu"

        def device_count(self) -> int:
            return 1

    with pytest.raises(ValueError, match=r"^2 stages need 2 devices; backend 'cpu' has 1$"):
        _channel().take_device(Backend())
