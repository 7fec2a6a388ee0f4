"""MemFerry's executor keeps the stream contract of its copies.

On the cpu backend copies are synchronous, so a breach could not show as wrong numbers here:
``tests/stream_recording.StreamCheck`` orders the copies as a device would.
"""
from __future__ import annotations

import copy

import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.weight_decay import param_groups
from tests.stream_recording import StreamCheck
from tests.test_memferry_numerics import TinyGPT, lm_loss


def _data(n, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (rows // 16, 16), generator=g), torch.randint(0, 64, (rows // 16, 16), generator=g))
            for _ in range(n)]


def _accumulated_reference(model, data, cfg):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    for x, y in data:
        (lm_loss(model(x), y) / len(data)).backward()
    opt.step()
    return dict(model.named_parameters())


def test_a_step_with_a_frozen_prefix_keeps_the_stream_contract(cpu_backend):
    """Every kind of copy the executor makes, in one step of two micro-batches: prefetched loads,
    offloaded activations, a DHA block's streamed weights and ring-written gradients (128 rows),
    device sums, a device-updated unit. Block 0 and the embeddings are frozen, so backward never
    reaches block 0: its load, prefetched by block 1's backward, is never used, and the executor
    used to free it while the copy could still be writing (on CUDA the allocator could hand that
    memory to the next kernel). Then a forward cut short, and close: the host buffers go back to
    the arena only once no copy reads them (close did not wait)."""
    torch.manual_seed(0)
    model = TinyGPT(d=128)  # 128 x 512 fp32 MLP weights: above DHA_LINEAR_MIN_BYTES
    for p in (model.emb.weight, model.pos, *model.blocks[0].parameters()):
        p.requires_grad_(False)
    plan = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha"),
                 UnitPlan("prefetch", "prefetch", offload=True, accumulate="device"),
                 UnitPlan("resident", "resident", optimizer="device")])
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = _data(2, rows=128)
    with StreamCheck(cpu_backend) as check:
        engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=check, loss_fn=lm_loss,
                          accumulation_steps=2)
        for x, y in data:
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / len(data))
        engine.step()
        state = engine.state_dict()["model"]
        cut_short = engine(data[0][0])  # a step cut short: its loads may still read host buffers at close
        engine.close()
        del cut_short
    assert check.breaches == []
    for name, p in _accumulated_reference(model, data, cfg).items():
        torch.testing.assert_close(state[name], p.detach(), atol=2e-6, rtol=2e-6, msg=name)
