"""The benchmark's "measured alone" rows: device compute without an optimizer (``torch``,
``optimizer: false``) and MemFerry's host AdamW without the device (``measure: host-optimizer``)."""
from __future__ import annotations

import pytest
import torch

from bench.scenario import load_scenario
from bench.systems.base import SystemContext
from bench.worker import run_spec


def _row(system: dict) -> dict:
    scenario = load_scenario("tiny", {"systems": [system], "steps": 2, "warmup": 1, "loss_after": 3, "timeline": False})
    return run_spec({"scenario": scenario.to_dict(), "label": system.get("label", system["name"]), "timeline_path": None},
                    in_process=True)


def _ctx(backend, options: dict) -> SystemContext:
    return SystemContext(backend=backend, device_index=0, family="gpt",
                         dims={"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16}, dtype=torch.float32,
                         batch=2, seq=16, optimizer={"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
                         options=options)


def _batch(backend):
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    return backend.to_device(tokens[:, :-1], 0), backend.to_device(tokens[:, 1:], 0)


def test_torch_without_optimizer_computes_without_updating(cpu_backend):
    from bench.systems.torch_ref import TorchSystem

    system = TorchSystem(_ctx(cpu_backend, {"precision": "pure", "recompute": False, "fused": False, "optimizer": False}))
    before = {k: v.clone() for k, v in system.model.state_dict().items()}
    inputs, targets = _batch(cpu_backend)
    losses = [float(system.step(inputs, targets)) for _ in range(3)]
    assert losses[0] == losses[1] == losses[2]  # nothing was updated between steps
    assert all(torch.equal(before[k], v) for k, v in system.model.state_dict().items())
    assert all(p.grad is None for p in system.model.parameters())  # dropped: no gradient memory carried over
    assert "no optimizer" in system.notes


def test_torch_without_optimizer_row_has_losses_and_timing(cpu_backend):
    row = _row({"name": "torch", "label": "torch-compute", "options": {"optimizer": False}})
    assert row["status"] == "ok", row
    assert row["step_s"] > 0 and len(set(row["losses"])) == 1


def test_memferry_host_optimizer_alone_updates_every_parameter_by_one_adam_step(cpu_backend):
    from bench.systems.memferry import MemFerrySystem

    options = {"plan": "auto", "max_grad_norm": None, "host_threads": None, "host_kernel": "auto", "loss_chunks": 1,
               "memory_margin": 0.10, "measure": "host-optimizer"}
    system = MemFerrySystem(_ctx(cpu_backend, options))
    try:
        assert system.engine.plan.describe()  # the plan asked for ("auto") gave way to every unit on the host
        assert all(s.home == "host" for s in system.engine.shadow.shadows)
        before = {k: v.clone() for k, v in system.engine.state_dict()["model"].items()}
        inputs, targets = _batch(cpu_backend)
        assert system.step(inputs, targets) is None
        after = system.engine.state_dict()["model"]
        for name, value in before.items():
            # AdamW's first step on a constant gradient g moves each weight by lr * g / (|g| + eps) = lr.
            torch.testing.assert_close(value - after[name], torch.full_like(value, 1e-2), rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        assert "host AdamW alone" in system.notes and "adamw" in system.notes
    finally:
        system.close()


def test_memferry_host_optimizer_alone_row_has_no_loss(cpu_backend):
    row = _row({"name": "memferry", "label": "memferry-host-optimizer", "options": {"measure": "host-optimizer"}})
    assert row["status"] == "ok", row
    assert row["loss"] is None and row["losses"] == [None] * 3 and row["step_s"] > 0
    assert row["tokens_per_s"] is None and row["tflops"] is None  # not a training step: no throughput


def test_memferry_bad_measure_is_refused_before_building_anything(cpu_backend):
    from bench.systems.memferry import MemFerrySystem

    with pytest.raises(ValueError, match="measure must be 'step' or 'host-optimizer'"):
        MemFerrySystem(_ctx(cpu_backend, {"measure": "optimizer"}))


def test_memferry_notes_wait_for_the_last_step_s_host_updates(cpu_backend):
    """The per-step host figures in the row's notes average every step's updates: read right
    after the last step, they must wait for that step's updates (still running on the host)."""
    import time

    from bench.systems.memferry import MemFerrySystem

    options = {"plan": "prefetch", "max_grad_norm": None, "host_threads": None, "host_kernel": "auto", "loss_chunks": 1,
               "memory_margin": 0.10, "measure": "step"}
    system = MemFerrySystem(_ctx(cpu_backend, options))
    kernel = system.engine.optimizer.kernel
    real = kernel.apply

    def slow(s, coef, **kwargs):  # a host update that outlasts the device's step
        time.sleep(0.05)
        return real(s, coef, **kwargs)

    kernel.apply = slow
    try:
        inputs, targets = _batch(cpu_backend)
        for _ in range(2):
            system.step(inputs, targets)
        notes = system.notes
        total = sum(s.master.numel() for s in system.engine.shadow.shadows)
        assert system.engine.optimizer.updated_numel == 2 * total, notes
        assert "host AdamW" in notes and "ns/param" in notes
    finally:
        system.close()
