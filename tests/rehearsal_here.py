"""One switch for tests that run MemFerry's rehearsal check on the cpu backend.

The cpu backend's virtual devices skip the check (``rehearsal.applies``). A test that turns it
on must also keep out what this machine's timings would add to the plan, or the plan would
depend on how busy the machine was: the sends before a step's last micro-batch
(``send_seconds``), a host-bound step's time beyond its host work (``step_gap``) and a
compute-bound step's time over its price (``compute_scale``).
"""
from __future__ import annotations

import pytest

from strategies.memferry import host_calibration, rehearsal, rehearsal_steps


def rehearse_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rehearse on this machine's cpu backend with no send time, step gap or compute scale priced."""
    monkeypatch.setattr(rehearsal, "applies", lambda backend: True)
    monkeypatch.setattr(rehearsal_steps, "send_seconds", lambda post, since: None)
    monkeypatch.setattr(rehearsal, "step_gap", lambda clock: None)
    monkeypatch.setattr(host_calibration, "compute_scale", lambda *args: None)
