"""One switch for tests that run MemFerry's rehearsal check on the cpu backend.

The cpu backend's virtual devices skip the check (``rehearsal.applies``). A test that turns it
on must also keep out what this machine's timings would add to the plan, or the plan would
depend on how busy the machine was: the sends before a step's last micro-batch
(``send_seconds``) and a host-bound step's time beyond its host work (``step_gap``).
"""
from __future__ import annotations

import pytest

from strategies.memferry import rehearsal, rehearsal_steps


def rehearse_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rehearse on this machine's cpu backend with no send time and no step gap priced."""
    monkeypatch.setattr(rehearsal, "applies", lambda backend: True)
    monkeypatch.setattr(rehearsal_steps, "send_seconds", lambda post, since: None)
    monkeypatch.setattr(rehearsal, "step_gap", lambda clock: None)
