"""The host rate a fit prices after a rebuild for memory: the first plan peaked over its budget,
the one made again is rehearsed in its turn, and the plan is priced on the timed rehearsals
together (``host_calibration.least_disturbed``): a disturbance only slows the host, so the least
reading of those the host settled through, each part at most what a disturbed one measured.

The cpu backend's virtual devices skip the check; these tests turn it on and set what it
measures, so nothing depends on this machine's timing."""
from __future__ import annotations

import pytest

import strategies.memferry.host_calibration as host_calibration
import strategies.memferry.rehearsal as rehearsal
import strategies.memferry.rehearsal_steps as rehearsal_steps
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.config import Plan
from strategies.memferry.host_calibration import DISTURBED, Reading, least_disturbed, reading
from strategies.memferry.host_optimizer import HostOptimizer
from tests.test_memferry_host_calibration import _measuring
from tests.test_memferry_rehearsal import _undercounting, true_min_budget  # noqa: F401  (a fixture)
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def test_the_host_rate_after_a_rebuild_for_memory_is_the_least_of_the_rehearsals(cpu_backend, monkeypatch,
                                                                                true_min_budget):  # noqa: F811
    """The first plan peaks over the budget (the memory model made to under-count) and is made
    again; the rehearsal after the rebuild measures the host 1.5x slower than the one before it
    (as a rebuild's freeing and pinning did on an H100): the plan is priced on the faster."""
    _undercounting(monkeypatch, 0.8)
    rate = {"s": 1e-9}  # the host updates' seconds per parameter the rehearsals report
    _measuring(monkeypatch, 0.0)
    monkeypatch.setattr(HostOptimizer, "split_since",
                        lambda self, start: (rate["s"], 0.0) if self.updated_numel else None)
    monkeypatch.setattr(host_calibration, "ratios", lambda plan, measured: (measured[0] / 1e-9, 1.0))
    monkeypatch.setattr(rehearsal, "replan", _slowing_after(rehearsal.replan, rate))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan="auto", sample=batch(),
                      device_budget=int(true_min_budget * 1.1), backend=cpu_backend, memory_margin=0.0)
    notes = engine.plan.notes
    assert any("(after margin 0% peaked at" in n for n in notes), notes  # made again for memory
    said = [n for n in notes if n.startswith("host rate:")]
    assert len(said) == 1 and "updates 1.50x" in said[0], said
    assert "over 2 timed rehearsals" in said[0] and "updates 1.00x, sums 1.00x" in said[0], said
    assert engine.plan.profile.host_update_scale == pytest.approx(1.0)
    engine.close()


def test_a_rehearsal_disturbed_after_a_rebuild_does_not_undercut_the_settled_one_before_it(
        cpu_backend, monkeypatch, true_min_budget):  # noqa: F811
    """The first plan peaks over the budget; its rehearsal read the host 1.2x its price with the
    kernel alone settled around it. The one after the rebuild reads 1.5x, the kernel alone at its
    profiled rate before the steps and 1.4x after them every time they run: it bounds the rate
    (not under the price, so not taken), and the plan is priced on the settled 1.2x, not on its
    price (H200, session 46: so taken, the 128-layer GPT was predicted 21 % short); and on the gap
    its steps ran beyond their host work (``with_gap``)."""
    _undercounting(monkeypatch, 0.8)
    rate = {"s": 1.2e-9}
    _measuring(monkeypatch, 0.0)
    monkeypatch.setattr(HostOptimizer, "split_since",
                        lambda self, start: (rate["s"], 0.0) if self.updated_numel else None)
    for module in (host_calibration, rehearsal):
        monkeypatch.setattr(module, "ratios", lambda plan, measured: (measured[0] / 1e-9, 1.0))
    monkeypatch.setattr(rehearsal, "replan", _slowing_after(rehearsal.replan, rate))
    alone = {"n": 0}

    def timings(engine):  # settled before the rebuild; disturbed after (1.0 before the steps, 1.4 after)
        alone["n"] += 1
        return 1.0 if rate["s"] < 1.5e-9 or alone["n"] % 2 else 1.4

    monkeypatch.setattr(rehearsal_steps, "alone_slowdown", timings)
    monkeypatch.setattr(host_calibration, "CEILING", 10.0)  # the ratios are made up: no ceiling on them
    asked, given, real = [], [], host_calibration.with_gap
    monkeypatch.setattr(rehearsal, "step_gap", lambda clock: asked.append(clock) or 0.05)
    monkeypatch.setattr(host_calibration, "with_gap", lambda *args: given.append(args[-1]) or real(*args))
    engine = MemFerry(qwen2_tied(), optim=AdamW(lr=1e-3), plan="auto", sample=batch(),
                      device_budget=int(true_min_budget * 1.1), backend=cpu_backend, memory_margin=0.0)
    notes = engine.plan.notes
    assert any("(after margin 0% peaked at" in n for n in notes), notes
    assert any(n.startswith("rehearsal clock 2:") and "still disturbed" in n for n in notes), notes
    for k, read in ((1, "1.20x"), (2, "1.50x")):  # each as measured against its own plan's price
        assert any(n.startswith(f"rehearsal clock {k}:") and f"its host work read {read} the plan's price of the "
                   f"updates, 1.00x of the sums" in n for n in notes), notes
    said = [n for n in notes if n.startswith("host rate:")]
    assert len(said) == 1 and "the last rehearsal's host stayed disturbed" in said[0], said
    assert "over 1 timed rehearsals" in said[0] and "updates 1.20x" in said[0], said
    assert engine.plan.profile.host_update_scale == pytest.approx(1.2)
    assert len(asked) == 1 and given == [0.05]  # the settled rehearsal's gap, though the last was disturbed
    engine.close()


def test_the_least_disturbed_rate_is_the_settled_rehearsals_bounded_by_what_disturbed_ones_measured():
    settled = Reading((1.17, 1.0), (1.17, 1.0), True)
    disturbed = Reading((1.0, 1.0), (1.2, 1.0), False)  # taken at its price: a bound, not a reading
    assert least_disturbed([settled, disturbed]) == (1.17, 1.0)
    assert least_disturbed([disturbed, settled]) == (1.17, 1.0)
    lower = Reading((1.0, 1.0), (1.1, 1.2), False)  # measured under the settled one: bounds it
    assert least_disturbed([Reading((1.3, 1.1), (1.3, 1.1), True), lower]) == (1.1, 1.1)
    assert least_disturbed([settled, Reading((1.05, 0.9), (1.05, 0.9), True)]) == (1.05, 0.9)  # a rebuild only slows
    assert least_disturbed([disturbed, Reading((1.1, 0.8), (1.4, 0.8), False)]) == (1.0, 0.8)  # none settled: taken
    plan = Plan([], host_s_per_param=2e-9, host_earlier_s_per_param=0.0)
    assert reading(plan, (3e-9, 0.0), (2e-9, 0.0), (1.0, DISTURBED * 1.5)) == Reading((1.0, 1.0), (1.5, 1.0), False)
    assert reading(plan, (3e-9, 0.0), (2.5e-9, 0.0), None).settled  # not timed alone: as a settled one
    assert reading(plan, (3e-9, 0.0), None, (1.0, DISTURBED * 1.5)) is None
    assert reading(Plan([], host_s_per_param=0.0), (3e-9, 0.0), (3e-9, 0.0), None) is None


def _slowing_after(replan, rate):
    """``replan`` that makes the host 1.5x slower for the rehearsals after it."""
    def slower(*args, **kwargs):
        rate["s"] = 1.5e-9
        return replan(*args, **kwargs)
    return slower
