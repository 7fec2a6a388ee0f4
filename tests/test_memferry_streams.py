"""MemFerry's executor keeps the stream contract of its copies, and rewrites a unit's host
gradient landing zone only once the host optimizer has read what landed there before.

On the cpu backend copies are synchronous, so neither could show as wrong numbers here:
``tests/stream_recording.StreamCheck`` orders the copies as a device would, and the landing-zone
test logs who writes the zone and when the optimizer said it was free.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Skipping(TinyGPT):
    """TinyGPT whose block ``skip`` is left out of the forward (as layer drop would)."""

    skip: int | None = None

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for i, blk in enumerate(self.blocks):
            if i != self.skip:
                x = blk(x)
        return self.head(self.ln_f(x))


class _Logged:
    """The host optimizer, logging submissions and the moments the executor learns a landing zone is free."""

    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def submit(self, index, *args, **kwargs):
        """Log, then submit."""
        self._log.append(("submit", index))
        return self._inner.submit(index, *args, **kwargs)

    def wait_consumed(self, index, zone=0):
        """Wait, then log."""
        self._inner.wait_consumed(index, zone)
        self._log.append(("free", index))


class _LogWrites(TorchDispatchMode):
    """Logs every op of this thread that writes into ``zone`` (a storage)."""

    def __init__(self, zone, index, log):
        super().__init__()
        self.ptr, self.index, self.log = zone.untyped_storage().data_ptr(), index, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for arg, value in zip(func._schema.arguments, args):
            if (arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor)
                    and value.untyped_storage().data_ptr() == self.ptr):
                self.log.append(("write", self.index))
        return func(*args, **(kwargs or {}))


def test_a_skipped_dha_block_waits_for_its_landing_zone_before_zeroing_it(cpu_backend):
    """Block 1 (DHA: the device writes its large weights' gradients home) runs in the first
    micro-batch and is skipped in the second. Its gradient is then zeroed in host memory at the
    end of backward; the first micro-batch's gradient may still be in that landing zone, being
    summed by the host optimizer's thread (it used to be zeroed without waiting)."""
    torch.manual_seed(0)
    model = _Skipping(d=128, layers=3)
    plan = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("dha", "dha"), UnitPlan("prefetch", "prefetch")])
    cfg = AdamW(lr=3e-3, weight_decay=0.1)
    data = _data(2, rows=32)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr)
    engine = MemFerry(copy.deepcopy(model), optim=cfg, plan=plan, backend=cpu_backend, loss_fn=lm_loss,
                      accumulation_steps=2)
    log: list[tuple[str, int]] = []
    unit = engine.executor.blocks[1]
    engine.executor.opt = engine.executor.post.opt = _Logged(engine.executor.opt, log)
    with _LogWrites(unit.grad_stage, unit.unit.index, log):
        for skip, (x, y) in zip((None, 1), data):
            engine.model.skip = ref.skip = skip
            engine.backward(lm_loss(engine(x), engine._to_device(y)) / 2)
            (lm_loss(ref(x), y) / 2).backward()
    engine.step()
    opt.step()
    state = engine.state_dict()["model"]
    engine.close()
    mine = [kind for kind, index in log if index == unit.unit.index]
    assert "write" in mine and "submit" in mine
    unread = False  # a submitted gradient the optimizer has not said it read
    for kind in mine:
        if kind == "write":
            assert not unread, f"the landing zone was written before the optimizer had read it: {mine}"
        unread = kind == "submit" or (unread and kind != "free")
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=2e-6, rtol=2e-6, msg=name)


def test_the_compute_stream_waits_on_each_load_once(cpu_backend, monkeypatch):
    """A load is waited on when its unit is used; releasing it afterwards adds no second wait
    (only a load never used, as a frozen prefix's, is waited on at its release)."""
    from strategies.memferry.executor import Executor

    waited = []
    real = Executor._wait_loaded

    def recording(self, ready):
        if ready is not None:
            waited.append(ready)
        real(self, ready)

    monkeypatch.setattr(Executor, "_wait_loaded", recording)
    torch.manual_seed(0)
    engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend, loss_fn=lm_loss)
    for x, y in _data(2, rows=64):
        engine.train_step(x, y)
    engine.close()
    # per step: forward loads 4 blocks, backward reloads the 3 not kept, and the rest unit (resident,
    # updated on the host) comes back once
    assert len(waited) == 2 * 8
    assert len({id(r) for r in waited}) == len(waited)


def test_a_clipped_step_with_norms_on_the_device_keeps_the_stream_contract(cpu_backend):
    """With clipping and every norm summed on the device, each host unit's running sum and the
    step's (norm, coefficient) travel home on the device→host stream: each copy waits for the
    kernels that make what it reads (the pair used to be stacked after the event its copy waits
    for, so on the H200 a step could read the previous step's coefficient)."""
    torch.manual_seed(0)
    model = TinyGPT()
    plan = Plan([UnitPlan("prefetch", "prefetch"), UnitPlan("resident", "resident", optimizer="device"),
                 UnitPlan("prefetch", "prefetch", recompute=True), UnitPlan("resident", "resident")])
    with StreamCheck(cpu_backend) as check:
        engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=3e-3, max_grad_norm=0.5), plan=plan, backend=check,
                          loss_fn=lm_loss)
        assert engine.clip.on_device
        for x, y in _data(2, rows=64):
            engine.train_step(x, y)
        history = engine.grad_norm_history
        engine.close()
    assert check.breaches == []
    assert len(history) == 2 and all(c < 1.0 for _, c in history)


def test_landing_wait_sleep_makes_blocking_landing_events_and_the_same_weights(cpu_backend, monkeypatch):
    """``AdamW(landing_wait="sleep")``: every event a gradient's landing is waited on is made
    blocking (the worker sleeps in it), and training is unchanged; the default spins."""
    made = []
    real = type(cpu_backend).event

    def recording(self, timing=False, blocking=False):
        made.append(blocking)
        return real(self, timing, blocking)

    monkeypatch.setattr(type(cpu_backend), "event", recording)
    weights = {}
    for wait in ("spin", "sleep"):
        made.clear()
        torch.manual_seed(0)
        engine = MemFerry(TinyGPT(), optim=AdamW(lr=1e-3, landing_wait=wait), plan="prefetch", backend=cpu_backend,
                          loss_fn=lm_loss)
        for x, y in _data(2, rows=64):
            engine.train_step(x, y)
        weights[wait] = engine.state_dict()["model"]
        post = engine.executor.post
        engine.close()
        sends = post.earlier_sends + 2 * 5  # no accumulation: every send is final, 5 host units a step
        assert made.count(True) == (sends if wait == "sleep" else 0), wait
    for name, w in weights["spin"].items():
        assert torch.equal(w, weights["sleep"][name]), name


def test_landing_wait_is_checked():
    with pytest.raises(ValueError, match="landing_wait must be 'spin' or 'sleep', got 'busy'"):
        AdamW(landing_wait="busy")
