"""Baselines with option ``ranks`` (`bench.systems.multirank`): one rank process per device behind one row.

On the cpu backend with gloo: a DDP-style toy system over 2 ranks trains exactly like the
single-process row on the same global batch, shows the per-rank device peaks reaching the notes
and a rank's out-of-memory reaching the row as ``oom`` (``fsdp2-offload`` over 2 ranks:
``test_bench_accumulation.test_two_ranks_accumulate_like_the_reference``); bad options
are refused before any process starts; DeepSpeed rows with ``ranks: 2`` read "missing" where
DeepSpeed is not installed.

The toy factory is module level: each rank process imports this module by name to call it.
"""
from __future__ import annotations

import importlib.util
import multiprocessing

import pytest
import torch

import bench.systems as systems
import xpu
from bench.scenario import load_scenario
from bench.systems import get_system
from bench.systems.base import BenchSystem, SystemContext
from bench.systems.multirank import MultiRankSystem, per_rank
from bench.worker import run_spec
from test_memferry_bench_dp import _Backend  # the option checks' stub backend, shared

OPTIMIZER = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
BASELINES = ("fsdp2-offload", "deepspeed-z2-offload", "deepspeed-z3-offload", "deepspeed-twinflow",
             "deepspeed-zenflow")
DEEPSPEED = BASELINES[1:]
TOY = "toy-dp"


class _DDPTorch(BenchSystem):
    """The scenario's model on the device, gradients averaged over the process group (DDP-style).

    Option ``oom_rank``: that rank runs out of memory while setting up (-1: none does).
    """

    def __init__(self, ctx: SystemContext) -> None:
        import torch.distributed as dist

        if ctx.device_index == ctx.options["oom_rank"]:
            raise torch.OutOfMemoryError(f"rank {ctx.device_index}: tried to allocate 1 TiB: out of memory")
        self.model = ctx.build_model(device=ctx.device, dtype=ctx.dtype)  # counted on the rank's virtual device
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ctx.adamw_kwargs())
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.notes = f"toy world={self.world}"

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        loss = self.model(inputs, targets)
        loss.backward()
        if self.world > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


@per_rank(TOY)
def make_toy(ctx: SystemContext) -> BenchSystem:
    """The toy system's factory (``ranks`` > 1: a :class:`MultiRankSystem` of it)."""
    return _DDPTorch(ctx)


@pytest.fixture
def toy_registered(monkeypatch):
    """The registry with the toy system added (restored afterwards)."""
    systems.registered_systems()  # discover first, so the restored registry is the full one
    monkeypatch.setattr(systems.SYSTEMS, "_plugins", dict(systems.SYSTEMS.plugins()))
    systems.register_system(TOY, f"{__name__}:make_toy", options={"ranks": 1, "oom_rank": -1})


@pytest.fixture
def worker_env(monkeypatch):
    """As in a bench worker: the cpu backend and one virtual device; the system gives its ranks one each."""
    from xpu.dist import free_port

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    monkeypatch.setenv("XPU_CPU_DEVICES", "1")
    # A single-process FSDP2 run in this process sets the rendezvous variables it lacks (port
    # 29500 by default); set them here so they are removed afterwards, not left to the
    # workers of later tests, which would reuse a port this run may still hold.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    xpu.reset_backend()
    yield
    xpu.reset_backend()


@pytest.fixture(autouse=True)
def _no_leftover_ranks():
    yield
    assert not [p.name for p in multiprocessing.active_children() if "-rank" in p.name]


def _row(name: str, options: dict, batch: int = 4) -> dict:
    scenario = load_scenario("tiny", {"batch": batch, "optimizer": OPTIMIZER, "timeline": False,
                                      "systems": [{"name": name, "options": options}]})
    return run_spec({"scenario": scenario.to_dict(), "label": name, "timeline_path": None}, in_process=True)


def _peaks(notes: str) -> list[float]:
    return [float(x.split("=")[1]) for x in notes.split("peak device GB per rank: ")[1].split(";")[0].split()]


def test_the_baselines_take_ranks_with_default_one():
    for name in BASELINES:
        assert get_system(name).options["ranks"] == 1, name


def test_per_rank_peaks_reach_the_notes_and_training_matches_one_process(worker_env, toy_registered):
    one = _row(TOY, {})
    two = _row(TOY, {"ranks": 2})
    assert one["status"] == two["status"] == "ok", (one.get("reason"), two.get("reason"))
    for got, want in zip(two["losses"], one["losses"]):
        assert abs(got - want) <= 1e-5, (two["losses"], one["losses"])
    assert two["peak_device_gb"] is None and one["peak_device_gb"] > 0
    notes = two["notes"]
    assert notes.startswith("ranks=2 (micro-batch 2 per rank); toy world=2; peak device GB per rank: "), notes
    peaks = _peaks(notes)
    # Each rank holds the whole model and its AdamW states on its own device, as the single process does.
    assert len(peaks) == 2 and all(0 < p <= one["peak_device_gb"] * 1.01 for p in peaks), (peaks, one["peak_device_gb"])


def test_a_rank_out_of_memory_reads_oom(worker_env, toy_registered):
    row = _row(TOY, {"ranks": 2, "oom_rank": 1})
    assert row["status"] == "oom", row
    assert row["reason"].startswith(f"OutOfMemoryError: {TOY} rank 1: OutOfMemoryError: rank 1: tried to allocate"), row


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
@pytest.mark.parametrize("name", DEEPSPEED)
def test_deepspeed_rows_with_two_ranks_read_missing(name, worker_env, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda *a, **k: pytest.fail("a process was about to start"))
    row = _row(name, {"ranks": 2})
    assert row["status"] == "missing", row
    assert "package 'deepspeed' is not installed" in row["reason"], row["reason"]


def _ctx(name: str, backend: _Backend | None = None, batch: int = 4, **options) -> SystemContext:
    return SystemContext(backend=backend or _Backend(), device_index=0, family="gpt",
                         dims=dict(layers=2, hidden=64, heads=4, vocab=256, seq=32), dtype=torch.float32, batch=batch,
                         seq=32, optimizer=OPTIMIZER, options={**get_system(name).options, **options})


@pytest.mark.parametrize("name, backend, batch, options, error, match", [
    ("fsdp2-offload", None, 4, {"ranks": 0}, ValueError,
     r"^fsdp2-offload: option 'ranks' must be at least 1 \(one process per device\), got 0$"),
    ("fsdp2-offload", None, 4, {"ranks": True}, ValueError, r"option 'ranks' must be an integer >= 1, got True"),
    ("deepspeed-z3-offload", None, 4, {"ranks": "2"}, ValueError, r"must be an integer >= 1, got '2'"),
    ("fsdp2-offload", None, 8, {"ranks": 4}, ValueError,
     r"^fsdp2-offload: 4 ranks need 4 devices \(one each\); backend 'cuda' has 2 \(lower option 'ranks'\)$"),
    ("deepspeed-z2-offload", None, 8, {"ranks": 3}, ValueError, r"3 ranks need 3 devices"),
    ("fsdp2-offload", _Backend("cpu", 1), 4, {"ranks": 3}, ValueError,  # cpu: virtual devices follow ranks
     r"^fsdp2-offload: batch 4 does not split into 3 equal micro-batches \(the scenario's batch is the global"),
    ("deepspeed-zenflow", None, 6, {"ranks": 2, "update_interval": 2}, None, None),  # fine up to the requirement
    ("deepspeed-twinflow", None, 4, {"ranks": 2, "ratio": 1.5}, ValueError, r"ratio must be a number in \[0, 1\]"),
])
def test_bad_options_fail_before_processes_start(name, backend, batch, options, error, match, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda *a, **k: pytest.fail("a process was about to start"))
    make = systems.load_factory(get_system(name))
    if error is None:
        if importlib.util.find_spec("deepspeed") is not None:
            pytest.skip("deepspeed is installed here: its ranks would start")
        error, match = ModuleNotFoundError, r"No module named 'deepspeed' \(needed by deepspeed-zenflow\)"
    with pytest.raises(error, match=match):
        make(_ctx(name, backend, batch, **options))


def test_cpu_virtual_devices_fixed_by_a_per_device_list_are_a_limit(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda *a, **k: pytest.fail("a process was about to start"))
    # A per-device capacity list fixes the virtual device count: the system must not raise it.
    monkeypatch.setenv("XPU_CPU_DEVICE_MEM", "1GB,1GB")
    with pytest.raises(ValueError, match=r"3 ranks need 3 devices \(one each\); backend 'cpu' has 2"):
        MultiRankSystem("fsdp2-offload", "bench.systems.fsdp2:make", _ctx("fsdp2-offload", _Backend("cpu", 2), 6,
                                                                          ranks=3))
