"""The split update (``split_update.py``): a copy-first pass that writes the working copy and
the step's fp32 gradient, then an in-place update from that gradient, bit-equal to one pass."""
from __future__ import annotations

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan, host_loops
from strategies.memferry.shadow_sizing import backup_elements, host_bytes_needed
from strategies.memferry.split_update import SplitUpdates
from strategies.memferry.units import split_units
from tests.test_memferry_frozen import frozen_model
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss
from tests.test_memferry_speculative_clip import CLIPS, run

KW = dict(grad_scale=1.0, decay=1 - 1e-3 * 0.1, beta1=0.9, beta2=0.99, bias_correction2_sqrt=0.3, eps=1e-8,
          step_size=1e-3)


def _inputs(n: int, off: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    state = [torch.randn(n + off, generator=gen)[off:], torch.randn(n + off, generator=gen)[off:],
             torch.rand(n + off, generator=gen)[off:]]
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2)]
    acc = torch.randn(n, generator=gen)
    return state, grads, acc


@pytest.mark.parametrize("terms", ["one", "pair", "sum and pair", "fp32 sum"])
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_first_then_in_place_from_its_gradient_equals_one_pass(terms, threads):
    """Each gradient shape the update reads (a landed one, a last pair, the sum before a last
    pair and the pair, an fp32 sum): the first pass leaves master and moments as they were and
    writes the one-pass update's working copy and the gradient it summed; the update from that
    gradient without a working copy then writes the one-pass update's master and moments."""
    loops = host_loops.host_loops()
    n, off = 70007, 3  # two threads' parts crossing many tiles, off any 16-byte boundary
    state, (g0, g1), acc = _inputs(n, off)
    grad = {"one": g0, "pair": (g0, g1), "sum and pair": (acc, g0, g1), "fp32 sum": acc}[terms]

    p, m, v = (t.clone() for t in state)
    work = torch.empty(n, dtype=torch.bfloat16)
    loops.adamw(p, grad, m, v, work, threads=threads, **KW)  # one pass

    q, mq, vq = (t.clone() for t in state)
    first = torch.full((n,), 9.0, dtype=torch.bfloat16)
    out = torch.full((n + off,), -1.0)[off:]
    loops.adamw(q, grad, mq, vq, first, threads=threads, copy_first=True, grad_out=out, **KW)
    assert all(torch.equal(a, b) for a, b in zip((q, mq, vq), state))  # master and moments untouched
    assert torch.equal(first, work)
    whole = {"one": g0.float(), "pair": g0.float() + g1.float(), "sum and pair": (acc + g0.float()) + g1.float(),
             "fp32 sum": acc}[terms]
    assert torch.equal(out, whole)
    loops.adamw(q, out, mq, vq, None, threads=threads, **KW)  # the second pass: no working copy
    assert all(torch.equal(a, b) for a, b in zip((q, mq, vq), (p, m, v)))
    assert not torch.equal(p, state[0])  # the update changed the master


def test_a_copy_first_pass_says_what_it_needs():
    loops = host_loops.host_loops()
    state, (g0, _), _ = _inputs(64, 0)
    with pytest.raises(ValueError, match="copy-first pass writes the working copy"):
        loops.adamw(*state[:1], g0, *state[1:], None, threads=1, copy_first=True, **KW)
    with pytest.raises(ValueError, match="grad_out is written by a copy-first pass only"):
        loops.adamw(*state[:1], g0, *state[1:], None, threads=1, grad_out=torch.zeros(64), **KW)
    with pytest.raises(ValueError, match="grad_out must be fp32"):
        loops.adamw(*state[:1], g0, *state[1:], torch.zeros(64, dtype=torch.bfloat16), threads=1, copy_first=True,
                    grad_out=torch.zeros(64, dtype=torch.bfloat16), **KW)


PLAN = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device"),
             UnitPlan("resident", "resident"), UnitPlan("prefetch", "prefetch", accumulate="device")])


def _train(cpu_backend, monkeypatch, split: bool, micro: list[int], n: int, order: str, background: bool = True):
    """Steps of ``micro[i]`` micro-batches (fewer than ``n``: cut short) in bf16; the losses, the
    state at the end (``state_dict``: after every second pass) and which units split.
    ``background=False``: second passes run only where they must (before the unit's next
    update, or a ``wait_all``), never while the host is idle."""
    if not background:
        monkeypatch.setattr(SplitUpdates, "waiting", lambda self: False)
    torch.manual_seed(0)
    data = iter(batches(sum(micro), seed=3))
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, weight_decay=0.1, host_kernel="single-pass", host_order=order,
                                             split_update=split),
                      plan=PLAN, backend=cpu_backend, loss_fn=lm_loss, accumulation_steps=n,
                      compute_dtype=torch.bfloat16)
    losses = []
    for count in micro:
        for _ in range(count):
            x, y = next(data)
            loss = lm_loss(engine(x), engine._to_device(y)) / n
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    state, units = engine.state_dict(), sorted(engine.optimizer._split.units)
    engine.close()
    monkeypatch.undo()
    return losses, state, units


@pytest.mark.parametrize("n,micro", [(4, [4, 4, 4]), (3, [3, 3, 3]), (4, [3, 1, 4]), (2, [2, 2, 2])])
@pytest.mark.parametrize("order", ["deadline", "landing"])
def test_split_updates_train_bit_equal_to_one_pass(cpu_backend, monkeypatch, n, micro, order):
    """Even and odd micro-batch counts, steps cut short, either task order, second passes in the
    host's idle time or only where they must run: every loss (the next forwards read the first
    passes' working copies) and the final masters and moments bit-equal to one-pass updates.
    Both ways of running second passes are checked against one one-pass run (it does not split,
    so where second passes run cannot change it)."""
    want_losses, want, none = _train(cpu_backend, monkeypatch, False, micro, n, order)
    assert none == []
    for background in (True, False):
        losses, state, units = _train(cpu_backend, monkeypatch, True, micro, n, order, background)
        assert units == [0, 2, 3, 4], background  # every host-updated unit (the rest too), device-summed 3 also
        assert losses == want_losses, background
        for name, t in state["model"].items():
            assert torch.equal(t, want["model"][name]), (background, name)
        for name, st in state["optimizer"].items():
            for key in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(want["optimizer"][name][key])), (
                    background, name, key)


def test_updates_split_by_default_only_where_clipping_is():
    assert not AdamW().splits and AdamW(max_grad_norm=1.0).splits
    assert not AdamW(max_grad_norm=1.0, split_update=False).splits and AdamW(split_update=True).splits


def test_by_default_updates_split_only_where_the_single_pass_loops_build(monkeypatch):
    from strategies.memferry import split_update

    clipped = AdamW(max_grad_norm=1.0)
    assert split_update.updates_split(clipped, data_parallel=False)
    assert not split_update.updates_split(clipped, data_parallel=True)
    # the torch kernel does not split: by default nothing does (its units keep their backup room)
    assert not split_update.updates_split(AdamW(max_grad_norm=1.0, host_kernel="torch"), data_parallel=False)
    assert split_update.updates_split(AdamW(max_grad_norm=1.0, host_kernel="torch", split_update=True), False)

    def unavailable():
        raise split_update.UnavailableError("no C compiler found")

    monkeypatch.setattr(split_update, "host_loops", unavailable)
    assert not split_update.updates_split(clipped, data_parallel=False)


def test_split_update_settings_say_what_would_work():
    with pytest.raises(ValueError, match="split_update must be True, False or None \\(on where clipping is\\), got 'yes'"):
        AdamW(split_update="yes")


def test_a_split_unit_keeps_its_steps_fp32_gradient_in_host_memory():
    units = split_units(TinyGPT())
    homes = {1}
    extra = (host_bytes_needed(units, homes, accumulate=True, split=True)
             - host_bytes_needed(units, homes, accumulate=True))
    assert extra == 0  # TinyGPT is fp32: its master is the working copy, nothing to split
    bf16 = split_units(TinyGPT().to(torch.bfloat16))
    extra = (host_bytes_needed(bf16, homes, accumulate=True, split=True)
             - host_bytes_needed(bf16, homes, accumulate=True))
    assert extra == 4 * sum(u.train_numel for u in bf16 if u.index not in homes)
    assert host_bytes_needed(bf16, homes, accumulate=False, split=True) == host_bytes_needed(bf16, homes)
    # with speculative clipping a split unit needs no backup: its first pass changes no state
    assert backup_elements(bf16, homes, budget=None, split=True) == 0
    assert backup_elements(bf16, homes, budget=None) == 3 * sum(u.train_numel for u in bf16 if u.index not in homes)
    assert (host_bytes_needed(bf16, homes, accumulate=True, backup_budget=None, split=True)
            == host_bytes_needed(bf16, homes, accumulate=True, split=True))


def _checkpointed(cpu_backend, split: bool):
    """Frozen parameters (a whole block, part of another, the embedding), 2 micro-batches a
    step: two steps, a checkpoint, a third step, the checkpoint loaded back, a fourth."""
    model = frozen_model()
    data = iter(batches(8, seed=4))
    engine = MemFerry(model, optim=AdamW(lr=3e-3, host_kernel="single-pass", split_update=split),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss,
                      accumulation_steps=2, compute_dtype=torch.bfloat16)

    def step():
        for _ in range(2):
            x, y = next(data)
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / 2)
        engine.step()

    step(), step()
    saved = engine.state_dict()
    step()
    engine.load_state_dict(saved)
    step()
    state, units = engine.state_dict(), sorted(engine.optimizer._split.units)
    engine.close()
    return state, units


def test_split_updates_keep_frozen_parameters_and_checkpoints_exact(cpu_backend):
    """A checkpoint taken while second passes may still wait holds them, loading one puts the
    state back under them, and frozen parameters are never split: bit-equal to one pass."""
    state, units = _checkpointed(cpu_backend, True)
    want, _ = _checkpointed(cpu_backend, False)
    assert units == [0, 2, 3, 4]  # block 1 is wholly frozen: nothing to update
    for name, t in state["model"].items():
        assert torch.equal(t, want["model"][name]), name
    for name, st in state["optimizer"].items():
        for key in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(want["optimizer"][name][key])), (name, key)


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("plan", ["prefetch", "resident"])
def test_clipped_split_updates_train_bit_equal_to_one_pass(cpu_backend, clip, plan):
    """With clipping (never, always, in some steps; a rate changed between speculation and
    step), split units speculate or wait with their first pass and make it again with the
    coefficient where the clip fires: every loss, norm, working copy, master and moment bit-equal
    to one-pass updates, and no split unit asks for backup room. Both modes are checked against
    one one-pass run that waits (one-pass speculation equals waiting bit for bit:
    test_memferry_speculative_clip.py)."""
    kw = dict(plan=plan, dtype="bf16", accumulation=2, kernel="single-pass", lr_between=1e-3)
    want = run(cpu_backend, CLIPS[clip], "wait", **kw)
    for mode in ("speculative", "wait"):
        got = run(cpu_backend, CLIPS[clip], mode, split=True, **kw)
        assert got["losses"] == want["losses"] and got["norms"] == want["norms"], mode
        for mine, theirs in zip(got["buffers"], want["buffers"]):
            assert all(torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k])) for k in mine), (
                mode, mine.keys())
        # which units the worker reaches before the coefficient (and the rate change) depends on
        # timing; that some first passes speculated, and none asked for backup room, does not
        assert got["stats"]["held_units"] == 0, mode
        assert (got["stats"]["speculated_units"] > 0) == (mode == "speculative"), mode


@pytest.mark.parametrize("clip", [None, 1.0])
def test_an_engine_splits_by_default_only_under_clipping(cpu_backend, clip):
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-2, host_kernel="single-pass", max_grad_norm=clip),
                      plan=Plan.uniform(4, UnitPlan("prefetch", "prefetch")), backend=cpu_backend, loss_fn=lm_loss,
                      accumulation_steps=2, compute_dtype=torch.bfloat16)
    try:
        assert engine.shadow.split == (clip is not None)
        assert bool(engine.optimizer._split.units) == (clip is not None)
    finally:
        engine.close()
