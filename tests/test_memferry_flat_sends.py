"""``AdamW(flat_sends=True)`` (``flat_sends.py``): a host-homed unit's gradients are gathered on the
device into one buffer laid out as their host targets, and go home in one copy. Training is
bit-equal to copies tensor by tensor (clipped, accumulated), the stream contract holds, and the
cost model counts the gathered buffer in the block's backward transient."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.block_costs import option_cost
from strategies.memferry.cost import links_from_probe
from strategies.memferry.flat_sends import gather, host_span
from strategies.memferry.planning import plan_for
from tests.stream_recording import StreamCheck
from tests.test_memferry_numerics import TinyGPT, lm_loss
from tests.test_memferry_scheduler_accum import batch, qwen2_tied


def test_host_span_covers_back_to_back_slices_and_nothing_else():
    buf = torch.arange(20.0)
    parts = [buf[0:6].view(2, 3), buf[6:10], buf[10:20].view(5, 2)]
    span = host_span(parts)
    assert span is not None and span.shape == (20,) and span.data_ptr() == buf.data_ptr()
    span[7] = -1.0  # a view: writes land in the targets
    assert parts[1][1] == -1.0
    tail = host_span([buf[4:10], buf[10:12]])
    assert tail is not None and tail.storage_offset() == 4 and tail.numel() == 8
    assert host_span([buf[0:6]]) is None  # one tensor: nothing to gain
    assert host_span([buf[0:6], buf[7:10]]) is None  # a gap
    assert host_span([buf[6:10], buf[0:6]]) is None  # out of order
    assert host_span([buf[0:4], torch.zeros(4)]) is None  # two storages
    assert host_span([buf[0:6].view(2, 3).t(), buf[6:10]]) is None  # not contiguous
    assert host_span([buf[0:4], buf[4:8].to(torch.float64)]) is None  # two dtypes


def test_gather_lays_the_sources_out_in_order(cpu_backend):
    srcs = [torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)]
    flat = gather(cpu_backend, [cpu_backend.to_device(s, 0) for s in srcs], 0, torch.bfloat16)
    assert flat.dtype == torch.bfloat16 and torch.equal(flat.cpu(), torch.cat([s.flatten() for s in srcs]))


def _train(backend, flat: bool, micro: int = 2, steps: int = 2):
    torch.manual_seed(0)
    plan = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device"),
                 UnitPlan("prefetch", "prefetch", recompute=True), UnitPlan("resident", "resident")])
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5, flat_sends=flat),
                      plan=plan, backend=backend, loss_fn=lm_loss, accumulation_steps=micro)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(micro):
            x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
            engine.backward(engine._loss(x, y) / micro)
        engine.step()
    state = copy.deepcopy(engine.state_dict()["optimizer"])
    engine.close()
    return state


def test_flat_sends_train_bit_equal_with_one_copy_home_per_send(cpu_backend, monkeypatch):
    home: list[int] = []  # pairs per copy_many into pinned host memory (the gradients' landing zones)
    real = type(cpu_backend).copy_many

    def counting(self, dsts, srcs, stream=None):
        if dsts and self.is_pinned(dsts[0]):
            home.append(len(dsts))
        return real(self, dsts, srcs, stream)

    monkeypatch.setattr(type(cpu_backend), "copy_many", counting)
    per_tensor = _train(cpu_backend, flat=False)
    assert max(home) > 1  # a unit's gradients tensor by tensor
    home.clear()
    flat = _train(cpu_backend, flat=True)
    assert home and set(home) == {1}, home  # each send one copy
    for unit, st in per_tensor.items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], flat[unit][k]), (unit, k)


def test_flat_sends_keep_the_stream_contract(cpu_backend):
    """The gathered buffer is made on the compute stream and read by the copy home on the
    device->host stream: the copy waits for the gather, and the buffer outlives the copy."""
    with StreamCheck(cpu_backend) as check:
        _train(check, flat=True)
    assert check.breaches == []


def test_the_cost_model_counts_the_gathered_gradients_in_the_backward_transient(cpu_backend):
    plan = plan_for(qwen2_tied(), batch(), None, backend=cpu_backend, memory_margin=0.0)
    links = links_from_probe(cpu_backend, 0)
    profile = plan.profile
    flat = dataclasses.replace(profile, flat_sends=True)
    grad_bytes = profile.blocks[0].numel * profile.dtype_bytes
    host, device = UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device")
    assert option_cost(flat, links, 0, host).trans == option_cost(profile, links, 0, host).trans + grad_bytes
    assert option_cost(flat, links, 0, device).trans == option_cost(profile, links, 0, device).trans


def test_flat_sends_is_checked():
    with pytest.raises(ValueError, match="flat_sends must be True or False, got 'yes'"):
        AdamW(flat_sends="yes")
