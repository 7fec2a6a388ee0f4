"""Data-parallel MemFerry: two ranks (gloo, cpu backend) train exactly like one process on both micro-batches."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies.memferry import AdamW, MemFerry, Plan
from strategies.weight_decay import param_groups
from xpu.dist import free_port, leave_rank
from test_memferry_numerics import TinyGPT, lm_loss

STEPS, WORLD = 6, 2


def _data(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (2 * WORLD, 16), generator=g), torch.randint(0, 64, (2 * WORLD, 16), generator=g))
            for _ in range(STEPS)]


CASES = [("prefetch", None), ("device2+recompute", 0.5), ("dha", None), ("resident2", 0.5)]


def _train(rank, case, out_dir):
    plan_spec, clip = CASES[case]
    torch.manual_seed(0)
    model = TinyGPT()
    engine = MemFerry(model, optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip),
                      plan=Plan.from_spec(plan_spec, 4), loss_fn=lm_loss, device=rank)
    losses = []
    for x, y in _data():
        half = x.shape[0] // WORLD  # each rank trains on its own micro-batch
        losses.append(engine.train_step(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]).item())
    state = engine.state_dict()  # a collective: every rank gets the whole
    host_units = [(s.unit.numel, s.master.numel()) for s in engine.shadow.shadows if s.home == "host"]
    loaded = engine.executor.bytes_h2d
    engine.close()
    torch.save({"losses": losses, "model": state["model"], "host_units": host_units, "bytes_h2d": loaded},
               os.path.join(out_dir, f"rank{rank}-case{case}.pt"))


def _auto(rank, out_dir):
    x, y = _data()[0]
    # Only the first rank gives a sample: the others must not profile or schedule on their own.
    sample = (x[:2], y[:2]) if rank == 0 else None
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(), plan="auto", loss_fn=lm_loss, device=rank, sample=sample,
                      device_budget=10**9)
    plan = engine.plan
    engine.close()
    torch.save({"units": plan.units, "rest": plan.rest_optimizer, "predicted": plan.predicted_step_s},
               os.path.join(out_dir, f"auto{rank}.pt"))


def _failing_auto(rank, out_dir):
    x, y = _data()[0]
    sample = (x[:2], y[:2]) if rank == 0 else None
    try:
        MemFerry(TinyGPT(), optim=AdamW(), plan="auto", loss_fn=lm_loss, device=rank, sample=sample, device_budget=4096)
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / f"failed{rank}.txt").write_text(outcome)


def _rank(rank, port, out_dir):
    """Every two-rank run of this module in one process group, one after another: a rank
    process (spawn, torch import, rendezvous) costs more than the runs themselves."""
    os.environ.update(XPU_BACKEND="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import xpu

    xpu.reset_backend()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for case in range(len(CASES)):
        _train(rank, case, out_dir)
    _auto(rank, out_dir)
    _failing_auto(rank, out_dir)  # last: whatever state its failure leaves cannot reach another run
    dist.barrier()  # gloo aborts a process whose peer tore its pairs down first (1 run in 6 here)
    dist.destroy_process_group()
    leave_rank(0)  # see xpu.dist.leave_rank: a torch thread alive at shutdown can abort the rank


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    """The folder the two ranks of :func:`_rank` wrote their results to."""
    out = tmp_path_factory.mktemp("dp")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{p}-{c}" for p, c in CASES])
def test_two_ranks_equal_one_process_on_the_whole_batch(ranks_out, case, cpu_backend):
    plan_spec, clip = CASES[case]
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)  # MemFerry's default decay groups
    ref_losses = []
    for x, y in _data():
        loss = lm_loss(model(x), y)  # the mean over both micro-batches = the mean of the ranks' means
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        ref_losses.append(loss.item())

    ranks = [torch.load(ranks_out / f"rank{r}-case{case}.pt") for r in range(WORLD)]
    mean_losses = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # they really trained on different data
    for r in ranks:  # each rank keeps (and updates) only its half of every host-homed unit's master
        assert r["host_units"] and all(master == -(-numel // WORLD) for numel, master in r["host_units"])
    for name, want in model.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["model"][name], want.detach(), atol=1e-5, rtol=1e-5, msg=name)
    if plan_spec == "prefetch":  # each rank's host link carried its shard of every load, the peers the rest
        one = _single_process_bytes_h2d(cpu_backend, plan_spec)
        for r in ranks:
            assert r["bytes_h2d"] == pytest.approx(one / WORLD, rel=0.02), (r["bytes_h2d"], one)


def _single_process_bytes_h2d(backend, plan_spec):
    """Bytes one process (no data parallelism) loads over the host link for the same steps."""
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1), plan=Plan.from_spec(plan_spec, 4),
                      loss_fn=lm_loss, backend=backend, device=0)
    for x, y in _data():
        engine.train_step(x[: x.shape[0] // WORLD], y[: y.shape[0] // WORLD])
    loaded = engine.executor.bytes_h2d
    engine.close()
    return loaded


def test_plan_auto_is_scheduled_once_and_shared_by_every_rank(ranks_out):
    plans = [torch.load(ranks_out / f"auto{r}.pt", weights_only=False) for r in range(WORLD)]
    assert plans[0]["predicted"] is not None
    assert plans[0] == plans[1]


def test_a_plan_the_first_rank_cannot_make_fails_every_rank_instead_of_hanging_them(ranks_out):
    """Only the first rank schedules; when no plan fits there, the others must hear of it (they
    raised nothing and waited for a plan, up to gloo's 30-minute default, before)."""
    first, other = ((ranks_out / f"failed{r}.txt").read_text() for r in range(WORLD))
    assert first.startswith("NoPlanFitsError: no plan fits a device budget"), first
    assert other.startswith("RuntimeError: rank 0 could not schedule MemFerry's plan: NoPlanFitsError: no plan fits"), other


def test_weight_loads_over_the_multipath_copier_train_exactly(cpu_backend):
    """ScaleUp-MemFerry's loads: with multipath on, every prefetch goes through the scaleup
    copier (direct link and relays through the cpu backend's peer devices), training stays
    exact, and the relays really carried bytes."""
    from test_memferry_numerics import batches, reference

    torch.manual_seed(0)
    model = TinyGPT(d=64)
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = batches(4)
    ref_losses, ref_params = reference(model, data, cfg)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan="prefetch", loss_fn=lm_loss, backend=cpu_backend,
                      multipath=True)
    assert engine.copier is not None and len(engine.copier.routes) > 1
    routed: dict[str, int] = {}
    orig = engine.copier.h2d

    def counting(*args, **kwargs):
        t = orig(*args, **kwargs)
        t.synchronize()
        for name, n in t.stats["bytes_per_route"].items():
            routed[name] = routed.get(name, 0) + n
        return t
    engine.copier.h2d = counting
    losses = [engine.train_step(x, y).item() for x, y in data]
    state = engine.state_dict()["model"]
    engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=1e-5, msg=name)
    assert sum(routed.values()) > 0
    assert any(n > 0 for name, n in routed.items() if name != "host->0")  # a relay through a peer carried bytes


def _stopping_rank(rank, port, out_dir):
    """Rank 1 stops itself (SIGSTOP) before its first step; rank 0 must fail within the bound."""
    import signal
    import time

    os.environ.update(XPU_BACKEND="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), XPU_COLLECTIVE_TIMEOUT_S="5")
    import xpu

    xpu.reset_backend()
    # The default group's own timeout is gloo's 30 minutes: MemFerry must not rely on it.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(), plan=Plan.from_spec("prefetch", 4), loss_fn=lm_loss, device=rank)
    x, y = _data()[0]
    (Path(out_dir) / f"ready{rank}").write_text("")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        engine.train_step(x[:2], y[:2])
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / "rank0.txt").write_text(f"{time.monotonic() - t0:.1f}\n{outcome}")
    os._exit(0)  # the peer is stopped: no orderly teardown is possible


def test_a_stopped_rank_makes_the_other_fail_in_bounded_time_naming_the_ranks(tmp_path):
    """A rank stopped by SIGSTOP: the other's gradient all-reduce ends with an error within the
    bound (XPU_COLLECTIVE_TIMEOUT_S), though the caller's default group has gloo's 30 minutes."""
    from tests.stopped_peer import run_until_reported

    elapsed, outcome = run_until_reported(_stopping_rank, (free_port(), str(tmp_path)), WORLD, tmp_path / "rank0.txt")
    assert outcome.startswith("CollectiveTimeoutError: data-parallel MemFerry, rank 0 of ranks [0, 1]: "), outcome
    assert "XPU_COLLECTIVE_TIMEOUT_S" in outcome and "a peer rank stopped or died" in outcome
    assert elapsed < 60
