"""Speculative clipping (AdamW clip_mode="speculative"): host updates start with coefficient 1 as
gradients land and roll back exactly when the clip fires. Bit-equal to clip_mode="wait".

Which units the worker reaches before the coefficient is known depends on timing; the runs here
call ``HostOptimizer.settle()`` before ``step()`` so the counts they assert depend only on the calls:
every unit is speculated except, after the first step, the one expected to land last."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.host_optimizer import HostOptimizer
from strategies.memferry.shadow_sizing import backup_elements, host_bytes_needed
from strategies.memferry.units import split_units
from tests.test_memferry_numerics import TinyGPT, batches, lm_loss

PLANS = {
    "prefetch": lambda: Plan.uniform(4, UnitPlan("prefetch", "prefetch")),
    # device-homed, resident, recompute and DHA-backward units together, the rest unit on the device
    "device": lambda: Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("prefetch", "prefetch"),
                            UnitPlan("resident", "resident", recompute=True, optimizer="device"),
                            UnitPlan("dha", "prefetch", recompute=True)], rest_optimizer="device"),
    # weights kept on the device, updated on the host: each update's device copy is reloaded once
    # it is published (accumulation 8's plan on the §3 GPT, bench/results/2026-12-05-h200-session33/)
    "resident": lambda: Plan.from_spec("resident4", 4),
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# Gradient norms of these runs are about 0.963, 0.987, 0.953: never / always / on some steps only.
CLIPS = {"never": 10.0, "always": 0.5, "some": 0.955}
STEPS = 3  # enough for steps that clip and one that does not, in every case here


def _model():
    torch.manual_seed(0)
    return TinyGPT()


def run(backend, clip, mode, plan="prefetch", dtype="fp32", accumulation=1, backup=None, lr_between=None,
        kernel="auto", split=False):
    """Train STEPS steps; returns losses, norms, every shadow buffer, the state dicts and clip stats."""
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip, clip_mode=mode, clip_backup_bytes=backup,
                host_kernel=kernel, split_update=split)
    engine = MemFerry(_model(), optim=cfg, plan=PLANS[plan](), backend=backend, loss_fn=lm_loss,
                      compute_dtype=DTYPES[dtype], accumulation_steps=accumulation)
    losses, norms = [], []
    data = batches(STEPS * accumulation)
    for step in range(STEPS):
        for x, y in data[step * accumulation:(step + 1) * accumulation]:
            loss = lm_loss(engine(x), engine._to_device(y)) / accumulation
            engine.backward(loss)
            losses.append(loss.detach().float().cpu())
        if lr_between is not None and step == 2:
            engine.set_lr(lr_between)  # after backward, before step: the speculative updates used the old rate
        engine.optimizer.settle()
        engine.step()
        norms.append(engine.last_grad_norm)
    state = engine.state_dict()
    buffers = [{k: getattr(s, k).detach().cpu().clone() for k in ("work", "master", "exp_avg", "exp_avg_sq")}
               | {"step": s.step} for s in engine.shadow.shadows]
    stats = engine.clip_stats()
    engine.close()
    return {"losses": losses, "norms": norms, "buffers": buffers, "state": state, "stats": stats}


def assert_bit_equal(a, b):
    assert len(a["losses"]) == len(b["losses"])
    for la, lb in zip(a["losses"], b["losses"]):
        assert torch.equal(la, lb)
    assert a["norms"] == b["norms"]
    for ba, bb in zip(a["buffers"], b["buffers"]):
        assert ba["step"] == bb["step"]
        for k in ("work", "master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ba[k], bb[k]), k
    for name, t in a["state"]["model"].items():
        assert torch.equal(t, b["state"]["model"][name]), name
    for name, st in a["state"]["optimizer"].items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], b["state"]["optimizer"][name][k]), (name, k)
        assert st["step"] == b["state"]["optimizer"][name]["step"]


def fired_steps(result, clip):
    """Indices of the steps whose clip coefficient was below 1 (as the engine computes it)."""
    return {i for i, n in enumerate(result["norms"]) if min(1.0, clip / (n + 1e-6)) != 1.0}


def fired(result, clip):
    """How many steps clipped."""
    return len(fired_steps(result, clip))


def assert_counts(stats, units, result, clip, room=None):
    """Clip counts of a settled run: per step, the units queued for speculation (all in the first,
    all but the last to land later) speculate while backup room for ``room`` units lasts (None:
    all); the speculated ones of a clipped step roll back. Where the norms are summed on the
    device, a clipped step stops queueing once its running norm makes it clip: those
    ``sure_units`` update once instead, and never in a step that does not clip."""
    room = units if room is None else room
    steps = fired_steps(result, clip)
    want = dict.fromkeys(("speculated_units", "held_units", "direct_units", "rolled_back_units", "rollback_steps"), 0)
    unclipped = 0  # units speculated in steps that do not clip (none of them is ever sure)
    for step in range(STEPS):
        queued = units if step == 0 else units - 1
        speculated = min(queued, room)
        want["speculated_units"] += speculated
        want["held_units"] += queued - speculated
        want["direct_units"] += units - queued
        want["rolled_back_units"] += speculated if step in steps else 0
        want["rollback_steps"] += int(step in steps and speculated > 0)
        unclipped += 0 if step in steps else speculated
    sure = stats["sure_units"]
    if not sure:
        assert {k: stats[k] for k in want} == want
        return
    assert steps, "a step that does not clip is never sure to"
    assert stats["speculated_units"] + stats["held_units"] + sure == want["speculated_units"] + want["held_units"]
    assert stats["direct_units"] == want["direct_units"] + sure
    assert stats["rolled_back_units"] == stats["speculated_units"] - unclipped
    assert stats["rollback_steps"] <= want["rollback_steps"]


def assert_rolled_back(stats, n_fired):
    """Every clipped step, and only those, rolled back; but one whose running norm made it sure
    to clip before its first speculation started (its next gradient landed first: timing) had
    nothing to roll back."""
    rolled = stats["rollback_steps"]
    assert rolled == n_fired or (stats["sure_units"] and rolled < n_fired), stats


def host_units(backend, plan="prefetch"):
    homes = PLANS[plan]()
    return sum(1 for up in homes.units if up.optimizer == "host") + (homes.rest_optimizer == "host")


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CLIPS))
def test_speculative_equals_wait_bit_for_bit(cpu_backend, plan, dtype, case):
    clip = CLIPS[case]
    wait = run(cpu_backend, clip, "wait", plan, dtype)
    spec = run(cpu_backend, clip, "speculative", plan, dtype)
    assert_bit_equal(spec, wait)
    n_fired = fired(wait, clip)
    assert {"never": n_fired == 0, "always": n_fired == STEPS, "some": 0 < n_fired < STEPS}[case], wait["norms"]
    units = host_units(cpu_backend, plan)
    s = spec["stats"]
    assert s["clipped_steps"] == n_fired and s["steps"] == STEPS
    assert_rolled_back(s, n_fired)
    assert_counts(s, units, wait, clip)
    assert wait["stats"]["rollback_steps"] == wait["stats"]["speculated_units"] == wait["stats"]["direct_units"] == 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", ["always", "some"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_speculative_equals_wait_with_accumulation(cpu_backend, dtype, case, plan):
    clip = 0.686 if case == "some" else CLIPS[case]  # norms of the summed halves lie near 0.68-0.69
    wait = run(cpu_backend, clip, "wait", plan, dtype, accumulation=2)
    spec = run(cpu_backend, clip, "speculative", plan, dtype, accumulation=2)
    assert_bit_equal(spec, wait)
    n_fired = fired(wait, clip)
    assert (n_fired == STEPS) if case == "always" else (0 < n_fired < STEPS), wait["norms"]
    assert_rolled_back(spec["stats"], n_fired)
    assert_counts(spec["stats"], host_units(cpu_backend, plan), wait, clip)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_step_after_fewer_backwards_than_declared_rolls_back_exactly(cpu_backend, dtype):
    def early(mode):
        cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.6, clip_mode=mode)
        engine = MemFerry(_model(), optim=cfg, plan=PLANS["device"](), backend=cpu_backend, loss_fn=lm_loss,
                          compute_dtype=DTYPES[dtype], accumulation_steps=3)
        data = batches(6)
        for step in range(3):  # two of the three declared micro-batches, then step()
            for x, y in data[2 * step:2 * step + 2]:
                engine.backward(lm_loss(engine(x), engine._to_device(y)) / 2)
            engine.optimizer.settle()
            engine.step()
        engine.synchronize()  # the last step's host updates may still run
        out = {"buffers": [{k: getattr(s, k).detach().cpu().clone() for k in ("work", "master", "exp_avg", "exp_avg_sq")}
                           for s in engine.shadow.shadows], "stats": engine.clip_stats()}
        engine.close()
        return out

    wait, spec = early("wait"), early("speculative")
    for a, b in zip(wait["buffers"], spec["buffers"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert spec["stats"]["clipped_steps"] == 3 and spec["stats"]["rollback_steps"] == 3


def test_a_bounded_backup_speculates_on_the_first_units_and_holds_the_rest(cpu_backend):
    units = [u for u in split_units(_model()) if u.trainable]
    block = units[0].train_numel * 12  # one block's master and moments
    wait = run(cpu_backend, CLIPS["some"], "wait")
    for budget, speculated in ((0, 0), (block + 11, 1), (2 * block, 2)):
        spec = run(cpu_backend, CLIPS["some"], "speculative", backup=budget)
        assert_bit_equal(spec, wait)
        assert_counts(spec["stats"], len(units), wait, CLIPS["some"], room=speculated)


def test_a_learning_rate_changed_between_backward_and_step_rolls_back_exactly(cpu_backend):
    wait = run(cpu_backend, CLIPS["never"], "wait", lr_between=1e-3)
    spec = run(cpu_backend, CLIPS["never"], "speculative", lr_between=1e-3)
    assert_bit_equal(spec, wait)
    assert spec["stats"]["clipped_steps"] == 0 and spec["stats"]["rollback_steps"] == 1


def test_host_bytes_count_the_backups():
    units = split_units(_model())
    trainable = sum(u.train_numel for u in units)
    base = host_bytes_needed(units, set())
    assert host_bytes_needed(units, set(), backup_budget=None) - base == 12 * trainable
    assert host_bytes_needed(units, set(), backup_budget=4000) - base == 4000
    assert backup_elements(units, set(), budget=4001) == 1000
    device = {units[0].index}
    assert backup_elements(units, device, budget=None) == 3 * (trainable - units[0].train_numel)


def test_auto_backups_take_half_the_host_memory_left_and_all_backups_are_refused_when_they_do_not_fit(cpu_backend):
    from xpu.errors import HostMemoryBudgetError

    units = split_units(_model())
    rest = host_bytes_needed(units, set())
    full = host_bytes_needed(units, set(), backup_budget=None) - rest
    cpu_backend.host_arena.budget = rest + full  # room for every backup beside the other buffers
    try:
        def shadow_backup(backup):
            cfg = AdamW(max_grad_norm=1.0, clip_backup_bytes=backup)
            engine = MemFerry(_model(), optim=cfg, plan=PLANS["prefetch"](), backend=cpu_backend, loss_fn=lm_loss)
            n = engine.shadow.backup.numel()
            engine.close()
            return n

        assert shadow_backup("auto") == full // 2 // 4  # half of what the other buffers leave
        assert shadow_backup(None) == full // 4
        cpu_backend.host_arena.budget = rest + full // 2
        with pytest.raises(HostMemoryBudgetError, match="speculative clipping's backups .*clip_mode='wait'"):
            shadow_backup(None)
        assert cpu_backend.host_arena.stats().in_use == 0
    finally:
        cpu_backend.host_arena.budget = None


@pytest.mark.parametrize("kwargs, match", [({"clip_mode": "eager"}, "clip_mode must be"),
                                           ({"clip_backup_bytes": -1}, "clip_backup_bytes"),
                                           ({"clip_backup_bytes": "lots"}, "clip_backup_bytes")])
def test_bad_clip_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW(max_grad_norm=1.0, **kwargs)


def test_speculative_is_the_default_and_needs_clipping():
    assert AdamW(max_grad_norm=1.0).speculative
    assert not AdamW().speculative and not AdamW(max_grad_norm=1.0, clip_mode="wait").speculative


# ---------------------------------------------------------------- two data-parallel ranks
WORLD = 2


# a device-homed unit (its norm joins the all-reduced host norm), DHA units (their updated shards are
# exchanged on the host, in landing order on every rank) and a prefetched one; the rest unit on the host
DP_PLAN = Plan([UnitPlan("resident", "resident", optimizer="device"), UnitPlan("dha", "dha"),
                UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha")])


def _rank(rank, port, out_dir):
    os.environ.update(XPU_BACKEND="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import xpu
    from xpu.dist import leave_rank

    xpu.reset_backend()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    data = batches(STEPS)
    out = {}
    for mode in ("wait", "speculative"):
        torch.manual_seed(0)
        engine = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.96, clip_mode=mode),
                          plan=DP_PLAN, loss_fn=lm_loss, device=rank)
        losses, norms = [], []
        for x, y in data:
            half = x.shape[0] // WORLD
            loss = lm_loss(engine(x[rank * half:(rank + 1) * half]), engine._to_device(y[rank * half:(rank + 1) * half]))
            engine.backward(loss)
            engine.optimizer.settle()
            engine.step()
            losses.append(loss.detach())
            norms.append(engine.last_grad_norm)
        state = engine.state_dict()
        out[mode] = {"losses": [t.cpu() for t in losses], "norms": norms, "state": state, "stats": engine.clip_stats()}
        engine.close()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank(0)  # see xpu.dist.leave_rank: a torch thread alive at shutdown can abort the rank


def test_two_ranks_speculative_equals_wait(tmp_path, cpu_backend):
    from xpu.dist import free_port

    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for r in range(WORLD):
        out = torch.load(tmp_path / f"rank{r}.pt")
        wait, spec = out["wait"], out["speculative"]
        assert all(torch.equal(a, b) for a, b in zip(spec["losses"], wait["losses"]))
        assert spec["norms"] == wait["norms"]
        for part in ("model", "optimizer"):
            for name, v in wait["state"][part].items():
                w = spec["state"][part][name]
                pairs = [(v, w)] if part == "model" else [(v[k], w[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
                assert all(torch.equal(a, b) for a, b in pairs), (part, name)
        n_fired = fired(wait, 0.96)
        assert 0 < n_fired < STEPS, wait["norms"]
        assert spec["stats"]["clipped_steps"] == n_fired
        assert_rolled_back(spec["stats"], n_fired)
        assert_counts(spec["stats"], 4, wait, 0.96)  # three host-homed blocks and the rest unit


def test_bench_notes_count_clipped_steps_and_rollbacks(cpu_backend):
    from bench.systems.memferry import MemFerrySystem
    from tests.test_bench_measured_alone import _batch, _ctx

    options = {"plan": "prefetch", "max_grad_norm": 1e-3, "clip_mode": "speculative", "host_threads": None,
               "host_kernel": "auto", "loss_chunks": 1, "memory_margin": 0.10, "measure": "step"}
    system = MemFerrySystem(_ctx(cpu_backend, options))
    try:
        inputs, targets = _batch(cpu_backend)
        for _ in range(2):
            system.step(inputs, targets)
        # the norms are summed on the device, and the first gradient's alone makes each step clip:
        # nothing is speculated, so nothing rolls back
        assert re.search(r"clip speculative, norms on the device: 2 of 2 steps clipped, 0 rolled back \(0 unit "
                         r"updates redone, [1-9]\d* not speculated in steps sure to clip", system.notes), system.notes
    finally:
        system.close()


def test_speculation_in_small_pieces_equals_wait(cpu_backend, monkeypatch):
    """Speculative updates cut into many pieces (the worker answers between them) give the same
    bits, and the same counts, as whole ones."""
    from strategies.memferry.host_kernel import SinglePassKernel

    monkeypatch.setattr(SinglePassKernel, "piece", 1000)
    clip = CLIPS["some"]
    wait = run(cpu_backend, clip, "wait", "prefetch", "bf16")
    spec = run(cpu_backend, clip, "speculative", "prefetch", "bf16")
    assert_bit_equal(spec, wait)
    assert_counts(spec["stats"], host_units(cpu_backend), wait, clip)


def test_speculation_with_torch_s_kernel_equals_wait(cpu_backend):
    """The three-pass torch kernel takes its backups and rollbacks by copies, chunk by chunk: the same bits."""
    clip = CLIPS["some"]
    wait = run(cpu_backend, clip, "wait", "prefetch", "bf16", kernel="torch")
    spec = run(cpu_backend, clip, "speculative", "prefetch", "bf16", kernel="torch")
    assert_bit_equal(spec, wait)
    assert_counts(spec["stats"], host_units(cpu_backend), wait, clip)


def test_bf16_units_update_into_their_spares_and_go_home_at_close(cpu_backend):
    """16-bit compute: a speculative update writes the new master and moments into the unit's spare
    (no backup copy: ``save`` is never passed), a rollback reads the untouched old ones, and close
    puts every unit's state back in the buffers it came with, values kept."""
    cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=CLIPS["some"], clip_mode="speculative")
    engine = MemFerry(_model(), optim=cfg, plan=PLANS["prefetch"](), backend=cpu_backend, loss_fn=lm_loss,
                      compute_dtype=torch.bfloat16)
    kernel = engine.optimizer.kernel
    if kernel.binds_state:
        pytest.skip(f"the {kernel.name} host kernel keeps its own references: units are backed up instead")
    calls, pieces = [], kernel.pieces

    def recorded(s, coef, save=None, source=None, whole=False):
        calls.append((save is not None, source is not None))
        return pieces(s, coef, save=save, source=source, whole=whole)

    kernel.pieces = recorded
    host = [s for s in engine.shadow.shadows if s.home == "host"]
    own = {id(s): (s.master, s.exp_avg, s.exp_avg_sq) for s in host}
    for x, y in batches(STEPS):
        engine.backward(lm_loss(engine(x), engine._to_device(y)))
        engine.optimizer.settle()
        engine.step()
    stats = engine.clip_stats()
    assert stats["speculated_units"] and stats["rolled_back_units"], stats  # committed and rolled back both
    assert not any(save for save, _ in calls) and any(source for _, source in calls)
    moved = [s for s in host if s.master.data_ptr() != own[id(s)][0].data_ptr()]
    assert moved  # some units' state lives in their spares now
    final = {id(s): [t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq)] for s in host}
    engine.close()
    for s in host:
        for now, mine, want in zip((s.master, s.exp_avg, s.exp_avg_sq), own[id(s)], final[id(s)]):
            assert now.data_ptr() == mine.data_ptr() and torch.equal(now, want)


@pytest.mark.parametrize("order", ["deadline", "landing"])
def test_a_clipped_step_updates_in_the_order_the_next_forward_needs(cpu_backend, monkeypatch, order):
    """When the clip fires, every held unit is re-applied (or updated once) after the coefficient
    lands; in deadline order ``rest`` (whose embeddings start the next forward) goes first, then
    the blocks by index, as ``cost.predict_clip_fired`` prices it; in landing order by index.
    The results are bit-equal either way (each unit's update is its own)."""
    resolving, updated = [], []
    real_resolve, real_update = HostOptimizer._resolve, HostOptimizer._update

    def resolve(self, coef):  # noqa: ANN001, ANN202
        resolving.append([])
        try:
            real_resolve(self, coef)
        finally:
            updated.append(resolving.pop())

    def update(self, index, coef, source=None):  # noqa: ANN001, ANN202
        if resolving:
            resolving[-1].append(index)
        real_update(self, index, coef, source)

    monkeypatch.setattr(HostOptimizer, "_resolve", resolve)
    monkeypatch.setattr(HostOptimizer, "_update", update)
    cfg = AdamW(lr=3e-3, max_grad_norm=CLIPS["always"], clip_mode="speculative", host_order=order)
    engine = MemFerry(_model(), optim=cfg, plan=PLANS["prefetch"](), backend=cpu_backend, loss_fn=lm_loss)
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), engine._to_device(y)))
        engine.optimizer.settle()
        engine.step()
    engine.close()
    rest = len(engine.model.blocks)  # the last unit
    want = [rest, 0, 1, 2, 3] if order == "deadline" else [0, 1, 2, 3, rest]
    assert updated and all(got == want for got in updated), updated
