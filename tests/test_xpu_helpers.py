"""xpu's shared helpers: the event timer and the distributed helpers every multi-process part uses."""
from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist

from xpu.dist import decide_on_first_rank, free_port, init_local_group
import xpu.timing as timing
from xpu.timing import event_seconds, median_event_seconds, occupy, pipelined_seconds


def test_event_timer_times_the_work_between_its_events(cpu_backend):
    b = cpu_backend
    stream = b.stream(0)
    x = b.to_device(torch.ones(256, 256), 0)
    ran = []
    seconds = event_seconds(b, stream, lambda: ran.append(x @ x))
    assert len(ran) == 1 and seconds >= 0.0
    calls = []
    median_event_seconds(b, stream, lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        median_event_seconds(b, stream, lambda: None, repeats=0)


def test_pipelined_timer_reads_the_host_time_of_issuing_and_queues_its_lead(cpu_backend, monkeypatch):
    b = cpu_backend
    stream = b.stream(0)
    dev, host = pipelined_seconds(b, 0, stream, lambda: time.sleep(0.02), 0.0)
    assert host >= 0.02 and dev >= 0.0
    products = []
    # Counted, not computed: 256 real products of the occupying size took 29 s of CI's two cores.
    monkeypatch.setattr(timing.torch, "mm", lambda *a, **k: products.append(1))
    monkeypatch.setitem(timing._product_s, (id(b), 0), 1e-3)  # one product takes 1 ms here
    ran = []
    pipelined_seconds(b, 0, stream, lambda: ran.append(1), 0.0105)
    assert ran == [1] and len(products) == 11  # ceil(10.5 ms / 1 ms) queued before the timed work
    products.clear()
    occupy(b, 0, stream, 10.0)
    assert len(products) == timing.OCCUPY_MAX  # a slow device's lead is bounded


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.fixture
def one_rank_group():
    init_local_group("gloo", 0, 1, free_port(), timeout_s=60)
    yield
    dist.destroy_process_group()


def test_first_rank_decides_and_its_failure_is_raised(one_rank_group):
    assert decide_on_first_rank(lambda: {"plan": 3}) == {"plan": 3}
    with pytest.raises(ZeroDivisionError):
        decide_on_first_rank(lambda: 1 / 0, what="the plan")
    sent = ValueError("a result that is an exception is raised on every rank")
    with pytest.raises(ValueError, match="raised on every rank"):
        decide_on_first_rank(lambda: sent)


def test_collective_timeout_reads_its_variable_and_names_it_when_bad(monkeypatch):
    from xpu.dist import TIMEOUT_ENV, collective_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout().total_seconds() == 300
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert collective_timeout().total_seconds() == 7.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"XPU_COLLECTIVE_TIMEOUT_S='{bad}' is not a positive number of seconds"):
            collective_timeout()
