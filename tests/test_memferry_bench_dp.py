"""`memferry-dp` in `xpu bench`: 2 rank processes (gloo, cpu backend) train like plain PyTorch on the whole batch."""
from __future__ import annotations

import os

import pytest
import torch

import xpu
from xpu import Capabilities
from strategies.models import build_model
from bench.scenario import load_scenario
from bench.systems import get_system
from bench.systems.base import SystemContext
from bench.worker import run_spec
from strategies.weight_decay import param_groups

OPTIMIZER = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _scenario(options: dict):
    # batch 4: two ranks, two rows each.
    return load_scenario("tiny", {"batch": 4, "optimizer": OPTIMIZER,
                                  "systems": [{"name": "memferry-dp", "options": options}]})


def _reference_losses(scenario, steps: int, clip: float | None) -> list[float]:
    """Plain PyTorch AdamW in this process on the whole batch: same seed, model and data as the worker's."""
    vocab = scenario.model["vocab"]
    tokens = torch.randint(0, vocab, (scenario.batch, scenario.seq + 1),
                           generator=torch.Generator().manual_seed(scenario.seed))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    torch.manual_seed(scenario.seed)
    model = build_model(scenario.family, **scenario.model_dims())
    o = scenario.optimizer
    # MemFerry's default groups: biases and norms without decay
    opt = torch.optim.AdamW(param_groups(model, o["weight_decay"]), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
    losses = []
    for _ in range(steps):
        loss = model(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def test_memferry_dp_is_registered_with_its_options():
    spec = get_system("memferry-dp")
    assert spec.target == "bench.systems.memferry_dp:make"
    assert spec.options == {"ranks": 2, "plan": "prefetch+recompute", "max_grad_norm": None, "clip_mode": "speculative",
                            "loss_chunks": 1,
                            "host_threads": None, "host_kernel": "auto", "memory_margin": 0.10}


@pytest.mark.parametrize("options", [
    {},                                                                          # prefetch+recompute, host AdamW
    {"plan": "device1+recompute", "max_grad_norm": 0.05, "loss_chunks": 2},      # device-homed unit, clipping on
    {"plan": "auto"},                                                            # rank 0 schedules for both
], ids=["prefetch", "device1-clip-chunks", "auto"])
def test_two_ranks_equal_plain_pytorch_on_the_whole_batch(options, monkeypatch):
    # As in a bench worker: this process sees one virtual device; the system gives its ranks one each.
    monkeypatch.setenv("XPU_BACKEND", "cpu")
    monkeypatch.setenv("XPU_CPU_DEVICES", "1")
    xpu.reset_backend()
    try:
        scenario = _scenario(options)
        row = run_spec({"scenario": scenario.to_dict(), "label": "memferry-dp", "timeline_path": None},
                       in_process=True)
    finally:
        xpu.reset_backend()
    assert row["status"] == "ok", row.get("reason")
    ref = _reference_losses(scenario, len(row["losses"]), options.get("max_grad_norm"))
    assert len(row["losses"]) == 4
    for got, want in zip(row["losses"], ref):  # rows round losses to 5 decimals
        assert abs(got - want) <= 1e-5, (row["losses"], ref)
    assert ref[-1] < ref[0]  # it trains
    # The ranks' memory is not the worker's: no device column, each rank's peak in the notes.
    assert row["peak_device_gb"] is None
    notes = row["notes"]
    assert "ranks=2 (micro-batch 2 per rank)" in notes, notes
    peaks = [float(x.split("=")[1]) for x in notes.split("peak device GB per rank: ")[1].split(";")[0].split()]
    assert len(peaks) == 2 and all(p > 0 for p in peaks), notes
    assert "rank 0 host optimizer ms/step" in notes


class _Backend:
    """Just enough of a backend for the option checks (no process may start)."""

    def __init__(self, device_type: str = "cuda", devices: int = 2) -> None:
        self.device_type = self.name = device_type
        self.dist_backend = "nccl" if device_type == "cuda" else "gloo"
        self.caps = Capabilities(virtual_devices=device_type == "cpu")
        self._devices = devices

    def memory_cap(self, index: int):
        return None

    def device_count(self) -> int:
        return self._devices

    def env_for_device_count(self, count: int):
        if not self.caps.virtual_devices or "," in os.environ.get("XPU_CPU_DEVICE_MEM", ""):
            return None
        return {"XPU_CPU_DEVICES": str(count)}


def _ctx(backend: _Backend | None = None, batch: int = 4, **options) -> SystemContext:
    opts = {**get_system("memferry-dp").options, **options}
    return SystemContext(backend=backend or _Backend(), device_index=0, family="gpt",
                         dims=dict(layers=2, hidden=64, heads=4, vocab=256, seq=32), dtype=torch.float32, batch=batch,
                         seq=32, optimizer=OPTIMIZER, options=opts)


@pytest.mark.parametrize("backend, batch, options, match", [
    (None, 4, {"ranks": 1}, r"at least 2, got 1; for one device use the 'memferry' system"),
    (None, 4, {"ranks": 0}, r"at least 2, got 0; for one device use the 'memferry' system"),
    (None, 4, {"ranks": True}, r"'ranks' must be an integer >= 2"),
    (None, 8, {"ranks": 4}, r"4 ranks need 4 devices \(one each\); backend 'cuda' has 2"),
    (_Backend("cpu", 2), 4, {"ranks": 3}, r"batch 4 does not split into 3"),  # cpu: virtual devices follow ranks
    (None, 6, {"ranks": 2, "plan": "fast"}, r"unknown plan 'fast'"),
    (None, 4, {"plan": "device3"}, r"unknown plan 'device3' for 2 blocks"),
    (None, 4, {"loss_chunks": 0}, r"loss_chunks must be an integer >= 1"),
    (None, 4, {"max_grad_norm": -1.0}, r"max_grad_norm must be positive"),
    (None, 4, {"host_kernel": "fast"}, r"host_kernel must be"),
    (None, 4, {"memory_margin": 1.5}, r"memory_margin must lie in"),
])
def test_bad_options_fail_before_processes_start(backend, batch, options, match, monkeypatch):
    import torch.multiprocessing as mp

    from bench.systems import memferry_dp as bench_dp

    def no_spawn(*a, **k):
        raise AssertionError("a process was about to start")

    monkeypatch.setattr(mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match=match):
        bench_dp.make(_ctx(backend, batch, **options))


def test_cpu_virtual_devices_fixed_by_a_per_device_list_are_a_limit(monkeypatch):
    import torch.multiprocessing as mp

    from bench.systems import memferry_dp as bench_dp

    monkeypatch.setattr(mp, "get_context", lambda *a, **k: pytest.fail("a process was about to start"))
    # A per-device capacity list fixes the virtual device count: the system must not raise it.
    monkeypatch.setenv("XPU_CPU_DEVICE_MEM", "1GB,1GB")
    with pytest.raises(ValueError, match=r"3 ranks need 3 devices \(one each\); backend 'cpu' has 2"):
        bench_dp.make(_ctx(_Backend("cpu", 2), 6, ranks=3))
