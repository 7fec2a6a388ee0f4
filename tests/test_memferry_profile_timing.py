"""How the profiler times passes (``pass_timing.timed``): a forward alone, a backward and a
recomputation issued ahead of the device (the longer of device and host time, behind a lead sized
from the host time of the round before); on virtual devices, whose work runs as it is issued,
both are the plain reading. ``pipelined_seconds`` is replaced by a stub that records its lead and
returns fixed figures, so nothing depends on this machine's timing."""
from __future__ import annotations

import dataclasses

import pytest

import strategies.memferry.pass_timing as pass_timing


class _Device:
    """A backend with real (not virtual) devices, as far as ``_timed`` asks."""

    def __init__(self, cpu_backend) -> None:  # noqa: ANN001
        self.caps = dataclasses.replace(cpu_backend.caps, virtual_devices=False)
        self._b = cpu_backend

    def current_stream(self, device: int):  # noqa: ANN201
        return self._b.current_stream(device)


@pytest.fixture
def leads(monkeypatch):
    """The leads ``_timed`` asked for; each call reads 1 ms on the device and 3 ms on the host."""
    asked: list[float] = []

    def stub(backend, device, stream, fn, lead_s):  # noqa: ANN001, ANN202
        asked.append(lead_s)
        fn()
        return 1e-3, 3e-3

    monkeypatch.setattr(pass_timing, "pipelined_seconds", stub)
    return asked


def test_a_pass_issued_ahead_waits_behind_a_lead_and_reads_the_longer_of_device_and_host(cpu_backend, leads):
    dev = _Device(cpu_backend)
    assert pass_timing.timed(dev, 0, lambda: None) == (1e-3, 3e-3)  # alone: the device's reading
    assert pass_timing.timed(dev, 0, lambda: None, host_before=0.004) == (3e-3, 3e-3)  # the host bounds it
    assert leads == [0.0, pytest.approx(pass_timing.LEAD_FACTOR * 0.004 + pass_timing.LEAD_MIN_S)]


def test_on_virtual_devices_both_ways_are_the_plain_reading(cpu_backend, leads):
    assert cpu_backend.caps.virtual_devices
    assert pass_timing.timed(cpu_backend, 0, lambda: None, host_before=0.004) == (1e-3, 3e-3)
    assert leads == [0.0]
