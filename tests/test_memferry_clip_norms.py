"""Clipping's norm summed on the device (clip_norms.py): the same coefficient as the host's
arithmetic, no wait in step(), no host read of a gradient for its norm, and no speculation in a
step already sure to clip."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.clip_norms import clips, device_coefficient, norm_on_device
from strategies.memferry.host_optimizer import HostOptimizer
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss, reference
from tests.test_memferry_speculative_clip import STEPS, assert_bit_equal, run

PREFETCH = lambda: Plan.uniform(4, UnitPlan("prefetch", "prefetch"))  # noqa: E731
WITH_DHA = lambda: Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha"),  # noqa: E731
                         UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device")])


def test_the_device_coefficient_is_torch_s_formula_in_fp64():
    """``min(1, max_norm / (norm + 1e-6))`` with a true division (``max_norm * (1 / x)`` would
    round twice); and a running sum that ``clips`` says will clip does."""
    g = torch.Generator().manual_seed(0)
    sqs = [0.0, 1e-300, 1.0, 0.999998, 1.000002, 4.0] + (10 ** (torch.rand(2000, generator=g, dtype=torch.float64)
                                                              * 24 - 12)).tolist()
    for max_norm in (1.0, 0.3, 7.5):
        for sq in sqs:
            norm, coef = device_coefficient(torch.tensor(sq, dtype=torch.float64), max_norm)
            assert float(norm) == pytest.approx(math.sqrt(sq), rel=1e-15, abs=0)
            assert float(coef) == min(1.0, max_norm / (float(norm) + 1e-6)), (sq, max_norm)
            assert clips(sq, max_norm) == (min(1.0, max_norm / (math.sqrt(sq) + 1e-6)) != 1.0)
    assert clips(1.0, 1.0) and not clips(0.998, 1.0)  # at the limit itself the coefficient is 1 / (1 + 1e-6)


@pytest.mark.parametrize("unit, steps, dp, on_device", [
    (UnitPlan("prefetch", "prefetch"), 1, False, True),
    (UnitPlan("resident", "resident", recompute=True), 1, False, True),
    (UnitPlan("prefetch", "dha"), 1, False, True),  # its weight gradients are made on the device
    (UnitPlan("dha", "dha"), 1, False, False),  # host_linear writes them home
    (UnitPlan("prefetch", "prefetch"), 4, False, False),  # the host sums the micro-batches
    (UnitPlan("prefetch", "prefetch", accumulate="device"), 4, False, True),
    (UnitPlan("prefetch", "prefetch"), 1, True, False),  # a rank brings home its shard
])
def test_which_units_have_their_norm_taken_on_the_device(unit, steps, dp, on_device):
    assert norm_on_device(unit, steps, dp) is on_device


def _engine(backend, plan, clip=0.5, mode="speculative"):
    torch.manual_seed(0)
    return MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip, clip_mode=mode),
                    plan=plan, backend=backend, loss_fn=lm_loss)


def test_norms_on_the_device_ask_the_host_for_nothing_and_train_like_torch(cpu_backend, monkeypatch):
    reads = []
    asked = []
    monkeypatch.setattr(HostOptimizer, "grad_sqnorm", lambda self: asked.append(1) or 0.0)
    engine = _engine(cpu_backend, PREFETCH())
    monkeypatch.setattr(engine.optimizer.kernel, "sqnorm", lambda t: reads.append(t.numel()) or 0.0)
    assert engine.clip.on_device
    data = batches(6)
    for x, y in data:
        engine.train_step(x, y)
    state = engine.state_dict()["model"]
    stats = engine.clip_stats()
    engine.close()
    assert asked == [] and reads == []  # step() never waited for the host, which read no gradient twice
    assert stats["clipped_steps"] > 0
    torch.manual_seed(0)
    _, ref = reference(TinyGPT(), data, AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5))
    for name, want in ref.items():
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def test_a_dha_unit_alone_has_its_norm_taken_on_the_host(cpu_backend, monkeypatch):
    """The DHA block's weight gradients are written home as they are made: the host reads that
    block for its norm (and step() waits for it); the device sums every other unit's squares."""
    engine = _engine(cpu_backend, WITH_DHA())
    reads = []
    sqnorm = engine.optimizer.kernel.sqnorm
    monkeypatch.setattr(engine.optimizer.kernel, "sqnorm", lambda t: reads.append(t.numel()) or sqnorm(t))
    assert not engine.clip.on_device
    assert engine.clip.device_normed == {0, 2, 4}  # two prefetched blocks and the rest unit; block 3 is device-homed
    dha_numel = engine.shadow.shadows[1].unit.train_numel
    data = batches(3)
    for x, y in data:
        engine.train_step(x, y)
    state = engine.state_dict()["model"]
    engine.close()
    assert reads == [dha_numel] * 3
    torch.manual_seed(0)
    _, ref = reference(TinyGPT(), data, AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5))
    for name, want in ref.items():
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def test_a_step_sure_to_clip_from_its_first_gradient_speculates_nothing(cpu_backend):
    """Every gradient alone is over the limit: nothing is speculated, nothing rolls back, and the
    result is still bit-equal to waiting for the coefficient."""
    wait = run(cpu_backend, 1e-3, "wait", dtype="bf16")
    spec = run(cpu_backend, 1e-3, "speculative", dtype="bf16")
    assert_bit_equal(spec, wait)
    s = spec["stats"]
    units = 5  # four prefetched blocks and the rest unit, all host-homed
    assert s["clipped_steps"] == STEPS
    assert s["speculated_units"] == s["rolled_back_units"] == s["rollback_steps"] == 0
    assert s["sure_units"] == units + (STEPS - 1) * (units - 1)  # every unit queued for speculation


def test_last_grad_norm_is_the_norm_torch_clips_by(cpu_backend):
    data = batches(1)
    engine = _engine(cpu_backend, PREFETCH(), clip=1e9)
    torch.manual_seed(0)
    model = copy.deepcopy(TinyGPT())
    engine.train_step(*data[0])
    norm = engine.last_grad_norm
    engine.close()
    lm_loss(model(data[0][0]), data[0][1]).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert norm == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("plan", [PREFETCH, lambda: Plan.uniform(4, UnitPlan("dha", "dha"))], ids=["device", "host"])
def test_the_norm_history_is_each_steps_norm_and_coefficient(cpu_backend, plan):
    """Wherever the norm is summed, ``grad_norm_history`` holds every step's norm (as
    ``last_grad_norm`` read after it) and its coefficient, ``min(1, max / (norm + 1e-6))``;
    its clipped steps are the ones counted; ``reset`` (after a rehearsal) forgets them."""
    engine = _engine(cpu_backend, plan(), clip=0.96)  # this model's norms: 0.93-0.99
    after = []
    for x, y in batches(6):
        engine.train_step(x, y)
        after.append(engine.last_grad_norm)
    history = engine.grad_norm_history
    clipped = engine.clipped_steps
    engine.clip.reset()
    forgotten = engine.grad_norm_history
    engine.close()
    assert [n for n, _ in history] == after
    assert [c for _, c in history] == [min(1.0, 0.96 / (n + 1e-6)) for n in after]
    assert sum(c != 1.0 for _, c in history) == clipped and 0 < clipped < 6
    assert forgotten == []
