"""Two accelerators (``pytest -m gpu``): data-parallel MemFerry, an MPress pipeline swapping
activations into the other device's memory, and the ScaleUp copier relaying through a peer.

Every test needs two devices of the auto-detected accelerator backend and skips otherwise
(no accelerator, or only one device). Spawned processes inherit the fixture's environment
(``XPU_BACKEND`` unset, so they auto-detect the same backend) and join a process group of
that backend's collective library (``backend.dist_backend``: NCCL on CUDA). The cpu-backend
counterparts are ``test_memferry_dp.py``, ``test_mpress_pipeline.py`` and
``test_scaleup_multipath.py``.

    python -m pytest -m gpu -q tests/test_multigpu.py
"""
from __future__ import annotations

import datetime
import os

# NVLink multicast (NVLS) stays off on the multi-GPU machines these run on: keep NCCL, symmetric
# memory and NVSHMEM from trying it, here and in every child (inherited, and re-applied when a
# child imports this module to run its rank function).
_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in _MULTICAST_OFF.items():
    os.environ.setdefault(_key, _value)

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies.memferry import AdamW, MemFerry, Plan
from xpu.dist import free_port
from test_memferry_dp import STEPS, WORLD, _data
from test_memferry_numerics import TinyGPT, lm_loss, reference

pytestmark = pytest.mark.gpu

PG_TIMEOUT_S = 60  # a rank that dies must not leave its peer waiting for NCCL's default 10 minutes


def _child_env() -> dict[str, str]:
    """What spawned ranks get on top of the inherited environment: the multicast switches as set here."""
    return {k: os.environ[k] for k in _MULTICAST_OFF}


@pytest.fixture
def two_devices(gpu_backend):
    """The accelerator backend, when it has at least two devices (skips otherwise)."""
    n = gpu_backend.device_count()
    if n < 2:
        pytest.skip(f"needs 2 accelerator devices; backend '{gpu_backend.name}' sees {n}")
    return gpu_backend


# ---------------------------------------------------------------------------------------------
# 1. Data-parallel MemFerry: two ranks, one device each, gradients reduced over the device's
#    collective library, train exactly like one process on the whole batch.

DP_PLANS = [("prefetch", None), ("device2+recompute", 0.5)]


def _dp_rank(rank, port, plan_spec, clip, out_dir, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import xpu

    xpu.reset_backend()
    backend = xpu.get_backend()
    # Each rank on its own device, as a torchrun script (or bench_dp's ranks) would set it.
    with backend.device_scope(rank):
        dist.init_process_group(backend.dist_backend, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        try:
            torch.manual_seed(0)
            engine = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip),
                              plan=Plan.from_spec(plan_spec, 4), loss_fn=lm_loss, backend=backend, device=rank)
            losses = []
            for x, y in _data():
                half = x.shape[0] // WORLD  # each rank trains on its own micro-batch
                losses.append(engine.train_step(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]).item())
            state = engine.state_dict()  # a collective: every rank gets the whole
            shadows = engine.shadow.shadows
            out = {"losses": losses, "model": state["model"], "bytes_h2d": engine.executor.bytes_h2d,
                   "copier": engine.copier is not None,
                   "host_units": [(s.unit.numel, s.master.numel()) for s in shadows if s.home == "host"],
                   "device_units": sum(s.home == "device" for s in shadows),
                   "backend": backend.name, "dist_backend": str(dist.get_backend(engine.dp.grad_group)),
                   "dp_device": str(engine.dp.device)}
            engine.close()
        finally:
            dist.destroy_process_group()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _check_data_parallel(b, tmp_path, plan_spec, clip, env):
    """Two ranks on devices 0 and 1 against plain PyTorch AdamW on the whole batch on device 0."""
    torch.manual_seed(0)
    model = TinyGPT()
    dev = b.device(0)
    data = [(x.to(dev), y.to(dev)) for x, y in _data()]
    # The mean loss over both micro-batches = the mean of the ranks' means.
    ref_losses, ref_params = reference(model.to(dev), data, AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip))

    mp.spawn(_dp_rank, args=(free_port(), plan_spec, clip, str(tmp_path), env), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        # The ranks ran on this backend's devices, and reduced gradients over its collective library.
        assert res["backend"] == b.name and res["dist_backend"] == b.dist_backend, res
        assert res["dp_device"] == str(b.device(r))
    # fp32 throughout; 5x test_memferry_dp's 1e-5: each rank's device kernels (cuBLAS, SDPA)
    # reduce over half the batch in another order than the full-batch reference, NCCL sums the
    # halves and the host AdamW is not torch's device AdamW, so gradients and updates differ by
    # fp32 rounding; AdamW's normalised steps carry that into the weights over 6 steps, still
    # far below one update (lr = 3e-3).
    tol = dict(abs=5e-5, rel=5e-5)
    mean_losses = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, **tol)
    assert ranks[0]["losses"] != ranks[1]["losses"]  # they really trained on different data
    for r in ranks:  # each rank keeps (and updates) only its half of every host-homed unit's master
        assert r["host_units"] and all(master == -(-numel // WORLD) for numel, master in r["host_units"])
        assert r["device_units"] == (3 if plan_spec.startswith("device2") else 0)  # 2 blocks + the rest unit
    for name, want in ref_params.items():
        for r in ranks:
            torch.testing.assert_close(r["model"][name], want.cpu(), atol=tol["abs"], rtol=tol["rel"], msg=name)
    return ranks


@pytest.mark.parametrize("plan_spec, clip", DP_PLANS)
def test_data_parallel_memferry_on_two_devices_equals_one_process(two_devices, tmp_path, plan_spec, clip):
    """MemFerry under data parallelism on devices 0 and 1 (gradients all-reduced and weight
    shards all-gathered over NCCL on CUDA) trains like plain AdamW on the whole batch."""
    ranks = _check_data_parallel(two_devices, tmp_path, plan_spec, clip, _child_env())
    # Each rank brought only its shard of every load over its host link (the ranks all-gathered
    # the rest device to device), so half of what one process loads for the same steps.
    torch.manual_seed(0)
    alone = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip),
                     plan=Plan.from_spec(plan_spec, 4), loss_fn=lm_loss, backend=two_devices, device=0)
    for x, y in _data():
        alone.train_step(x[: x.shape[0] // WORLD], y[: y.shape[0] // WORLD])
    one = alone.executor.bytes_h2d
    alone.close()
    for res in ranks:
        assert not res["copier"]  # no relays under DP: the peers' links carry their own shards
        assert res["bytes_h2d"] == pytest.approx(one / WORLD, rel=0.02), (res["bytes_h2d"], one)


# ---------------------------------------------------------------------------------------------
# 2. MPress: a two-stage pipeline, one stage per device, stage 0's saved activations swapped
#    into device 1's memory (and stage 1's into device 0's), against the same run keeping them.

PIPE_DIMS = dict(layers=4, hidden=128, heads=4, vocab=256, seq=64)
PIPE_RUN = dict(schedule="1f1b", microbatches=4, batch=8, steps=2, lr=0.1)
# Stage 0 holds blocks 0-1, stage 1 blocks 2-3 (an even split).
PEER_PLAN = {0: {0: "peer:1", 1: "peer:1"}, 1: {2: "peer:0", 3: "peer:0"}}
HOST_PLAN = {0: {0: "host", 1: "recompute"}, 1: {2: "host", 3: "recompute"}}


def _pipeline_jobs():
    from strategies.mpress.pipeline import PipelineJob

    # profile=True: the schedule's shape-inference forward happens in the profiled warm-up, so
    # the measured steps' counters are exactly steps x micro-batches, and the forced plan's peer
    # regions are sized from the profile as the planner would (no fallback to the host).
    return {name: PipelineJob(PIPE_DIMS, plan=plan, profile=True, **PIPE_RUN)
            for name, plan in (("keep", "keep"), ("peer", PEER_PLAN), ("host", HOST_PLAN))}


def _pipeline_stage(rank, port, jobs, out_dir, env):
    os.environ.update(env)
    torch.set_num_threads(1)  # as launch() does: the stage processes share the host's cores
    import xpu
    from strategies.mpress.pipeline import run_jobs

    xpu.reset_backend()
    backend = xpu.get_backend()
    # run_jobs under a script's own process group (as under torchrun), each rank on its own
    # device: NCCL stages the object collectives (plans, profiles, pool handles) through it.
    with backend.device_scope(rank):
        dist.init_process_group(backend.dist_backend, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        try:
            results = run_jobs(jobs, backend)
        finally:
            dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"stage{rank}.pt"))


def _run_pipeline(jobs, out_dir, env):
    """``results[job][rank]`` of ``jobs`` on two :func:`_pipeline_stage` processes (what launch returns)."""
    for job in jobs:
        job.validate(2)
    mp.spawn(_pipeline_stage, args=(free_port(), jobs, str(out_dir), env), nprocs=2, join=True)
    per_rank = [torch.load(os.path.join(out_dir, f"stage{r}.pt"), weights_only=False) for r in range(2)]
    return [[per_rank[r][j] for r in range(2)] for j in range(len(jobs))]


def _assert_pipeline_matches(b, name, res, ref, keep=None):
    """One job's stages ran on devices 0 and 1 and match the unpipelined ``ref`` (and ``keep``, if given)."""
    for r, stage in enumerate(res):
        assert "error" not in stage, (name, r, stage["error"])
    for step, ref_loss in enumerate(ref["losses"]):
        mean = sum(res[-1]["losses"][step]) / len(res[-1]["losses"][step])
        # Device kernels against the cpu reference: rounding in a different order.
        assert abs(mean - ref_loss) < 1e-4, (name, step, mean, ref_loss)
        if keep is not None:  # the same kernels on the same devices: only where bytes lived differs
            assert res[-1]["losses"][step] == pytest.approx(keep[-1]["losses"][step], abs=1e-6, rel=1e-6), (name, step)
    seen = set()
    for r, stage in enumerate(res):
        for n, g in stage["grads"].items():
            assert g.device == b.device(r), (name, r, n, g.device)  # the stage ran on device `rank`
            g = g.cpu()
            # Last step's gradients, taken after a step of SGD: they check the updated weights too.
            torch.testing.assert_close(g, ref["grads"][n], atol=1e-5, rtol=1e-4, msg=f"{name} {n} vs reference")
            if keep is not None:
                torch.testing.assert_close(g, keep[r]["grads"][n].cpu(), atol=1e-6, rtol=1e-5, msg=f"{name} {n} vs keep")
            seen.add(n)
    assert seen == set(ref["grads"]), f"{name}: some parameters got no gradient"


def _check_pipeline(b, tmp_path, env):
    """Run keep / peer / host+recompute jobs on a 2-stage pipeline; compare them and the unpipelined model."""
    from strategies.mpress.pipeline import reference

    jobs = _pipeline_jobs()
    results = dict(zip(jobs, _run_pipeline(list(jobs.values()), tmp_path, env)))
    ref = reference(jobs["keep"])
    keep = results["keep"]
    for name, res in results.items():
        _assert_pipeline_matches(b, name, res, ref, None if name == "keep" else keep)

    n_fwd = PIPE_RUN["steps"] * PIPE_RUN["microbatches"]
    p0, p1 = results["peer"]
    for stage, owner, peer in ((p0, p1, 1), (p1, p0, 0)):
        s = stage["stats"]
        moved = s["bytes"].get(f"peer:{peer}", 0)
        # Bytes really went to the other device's pool, nothing fell back to the host, and all came back.
        assert moved > 0 and s["bytes"].get("host", 0) == 0 and s["fallbacks"] == 0, s
        assert s["swapped_in"] == moved, s
        # ... and lived in this stage's region of the pool the other stage allocated on its device.
        assert 0 < stage["region_peak"][peer] <= owner["hosted_pool_bytes"], (stage["region_peak"], owner["hosted_pool_bytes"])
        assert set(stage["decisions"].values()) == {f"peer:{peer}"}, stage["decisions"]
    # No assertion on stage 0's own peak: at these sizes the swap transients (a block swapped back
    # plus the next one fetched ahead) can match two micro-batches kept; the region peaks above
    # show the bytes lived on the other device.
    for stage in results["host"]:
        s = stage["stats"]
        assert s["bytes"].get("host", 0) > 0 and s["swapped_in"] == s["bytes"]["host"], s
        assert s["recompute_reruns"] == n_fwd, s
    for stage in keep:
        assert set(stage["stats"]["bytes"]) <= {"keep"}, stage["stats"]
    return results


def test_mpress_pipeline_swaps_activations_into_the_other_device(two_devices, tmp_path):
    """Stage 0 on device 0 swaps its blocks' saved activations into device 1's memory (CUDA
    IPC peer pool), stage 1 into device 0's; losses and gradients equal the all-keep run and
    the unpipelined model, and the executors counted the peer bytes."""
    if not two_devices.caps.ipc:
        pytest.skip(f"backend '{two_devices.name}' cannot share device buffers between processes (caps.ipc)")
    _check_pipeline(two_devices, tmp_path, _child_env())


def test_mpress_launch_runs_one_stage_per_device(two_devices):
    """The library's own spawner, ``pipeline.launch``: its stage processes join the backend's
    collective library on their own, each stage on device ``rank``, and train like the model."""
    from strategies.mpress.pipeline import PipelineJob, launch, reference

    job = PipelineJob(PIPE_DIMS, **{**PIPE_RUN, "steps": 1})
    (res,) = launch([job], 2, env={**_child_env(), "XPU_COLLECTIVE_TIMEOUT_S": str(PG_TIMEOUT_S)})
    _assert_pipeline_matches(two_devices, "launch", res, reference(job))


# ---------------------------------------------------------------------------------------------
# 3. ScaleUp: one host -> device 0 copy split over device 0's own host link and a relay through
#    device 1 (its host link, then a peer copy into device 0).

def _check_multipath(b, nbytes, chunk_bytes):
    """Copy ``nbytes`` of pinned host memory to device 0 over every route; returns the transfer's stats."""
    from scaleup import MultiPathCopier

    # probe=None: start from nominal link rates, not whatever probe is cached on the machine.
    copier = MultiPathCopier(b, 0, chunk_bytes=chunk_bytes, probe=None)
    names = {r.name for r in copier.routes}
    assert {"host->0", "host->1->0"} <= names, names
    src = b.host_arena.empty(nbytes)
    try:
        gen = torch.Generator().manual_seed(0)
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        copier.h2d(src[: 4 * chunk_bytes]).synchronize()  # warm-up: first copies on fresh streams and peers
        t = copier.h2d(src)
        out = t.synchronize()
        assert out.device == b.device(0)
        assert torch.equal(out.cpu(), src)  # byte-exact
        stats = dict(t.stats)
    finally:
        copier.close()
        b.host_arena.release(src)
    assert not stats["dropped"], stats["dropped"]
    assert sum(stats["bytes_per_route"].values()) == nbytes
    print({k: stats[k] for k in ("bytes_per_route", "chunks_per_route", "GBps", "shares")})
    return stats


def test_multipath_copy_to_device0_uses_both_devices_host_links(two_devices):
    """256 MiB host -> device 0 over the direct link and the relay through device 1 (staged in
    device 1's memory, then peer-copied): the bytes arrive exact and both routes carried some."""
    b = two_devices
    if not b.can_access_peer(1, 0):
        pytest.skip(f"devices 1 and 0 of backend '{b.name}' have no peer access: no relay route")
    chunk = 8 << 20
    stats = _check_multipath(b, 256 << 20, chunk)
    per_route = stats["bytes_per_route"]
    assert per_route["host->0"] > 0 and per_route["host->1->0"] > 0, per_route
    assert stats["chunks"] == 32
    # The relay's chunks really went through device 1's memory, within the pool's bound.
    assert 0 < stats["pool_high_water"][1] <= stats["pool_bound"][1], (stats["pool_high_water"], stats["pool_bound"])
