"""MemFerry's set-up frozen out of Python's full garbage collections (``gc_pauses.py``): what
the set-up made alive is not walked by a collection while the engine is open, garbage made
before it is collected first (never frozen), and closing the last engine thaws everything."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, gc_pauses
from strategies.models import build_model


class _Cycle:
    """A garbage cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _engine(cpu_backend, freeze_setup: bool | None = True) -> tuple[MemFerry, tuple[torch.Tensor, torch.Tensor]]:
    """A 2-block engine, frozen unless said (the cpu backend's default is not to)."""
    torch.manual_seed(0)
    model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    return MemFerry(model, optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend,
                    freeze_setup=freeze_setup), batch


def _walked(obj: object) -> bool:
    """Whether a full collection walks ``obj`` (frozen objects are not among gc.get_objects())."""
    return any(o is obj for o in gc.get_objects())


def test_the_setup_is_frozen_while_open_and_thawed_at_close(cpu_backend):
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage
    engine, (x, y) = _engine(cpu_backend)
    assert gone() is None  # collected before the freeze: never kept alive by it
    assert gc_pauses.holders() == 1 and gc.get_freeze_count() > 0
    assert not _walked(engine.shadow) and not _walked(engine.optimizer)
    engine.train_step(x, y)
    engine.synchronize()
    made = _Cycle()  # what steps make is walked and collected as before
    assert _walked(made)
    engine.close()
    assert gc_pauses.holders() == 0 and gc.get_freeze_count() == 0


@pytest.mark.parametrize("freeze_setup", [False, None])
def test_off_or_on_virtual_devices_the_collector_is_left_as_it_was(cpu_backend, freeze_setup):
    """False, and the default on the cpu backend's virtual devices (real devices freeze)."""
    engine, _ = _engine(cpu_backend, freeze_setup=freeze_setup)
    assert gc_pauses.holders() == 0 and gc.get_freeze_count() == 0 and _walked(engine.shadow)
    engine.close()


def test_a_plan_built_again_frees_the_old_parts_and_freezes_the_new(cpu_backend):
    """The old shadow is collected when a plan is built again (its engine's hold released first);
    the new parts are frozen under the same single hold."""
    from strategies.memferry.rehearsal import _rebuild

    engine, (x, y) = _engine(cpu_backend)
    old = weakref.ref(engine.shadow)
    _rebuild(engine, engine.plan)
    assert old() is None
    assert gc_pauses.holders() == 1 and not _walked(engine.shadow)
    engine.train_step(x, y)
    engine.close()
    assert gc.get_freeze_count() == 0


def test_the_last_of_two_engines_to_close_thaws(cpu_backend):
    first, _ = _engine(cpu_backend)
    second, _ = _engine(cpu_backend)
    assert gc_pauses.holders() == 2
    first.close()
    assert gc_pauses.holders() == 1 and not _walked(second.shadow)
    second.close()
    assert gc_pauses.holders() == 0 and gc.get_freeze_count() == 0


def test_a_refused_plan_leaves_nothing_frozen(cpu_backend):
    """A given plan peaking over the budget is refused after the rehearsal built it: its hold goes
    with the parts it gave back."""
    from strategies.memferry.rehearsal import PlanOverBudgetError

    torch.manual_seed(0)
    model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    x = torch.randint(0, 64, (2, 16))
    with pytest.raises(PlanOverBudgetError, match="the given plan peaks at"):
        MemFerry(model, optim=AdamW(lr=1e-3), plan="device2", backend=cpu_backend, sample=(x, x),
                 device_budget="400KB", freeze_setup=True)
    assert gc_pauses.holders() == 0 and gc.get_freeze_count() == 0
