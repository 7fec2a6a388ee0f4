"""MPress executor on one accelerator (``pytest -m gpu``): host swap and recompute under a device cap."""
from __future__ import annotations

import pytest
import torch

from strategies.models import build_model
from strategies.mpress import StageExecutor, split_model
from strategies.mpress.stages import lm_loss

pytestmark = pytest.mark.gpu

DIMS = dict(layers=4, hidden=256, heads=4, vocab=512, seq=256)



@pytest.mark.parametrize("decision", ["host", "recompute"])
def test_stage_under_a_cap_with_swap_or_recompute_matches_keep(gpu_backend, decision):
    b = gpu_backend
    idx = torch.randint(DIMS["vocab"], (8, DIMS["seq"]), generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("keep", decision):
        torch.manual_seed(0)
        stage = split_model(build_model("gpt", **DIMS), 1)[0].to(b.device(0))
        ex = StageExecutor(b, 0, {} if mode == "keep" else {i: mode for i in range(DIMS["layers"])},
                           params=list(stage.parameters()))
        stage.executor = ex
        x, y = b.to_device(idx, 0), b.to_device(idx.roll(1, 1), 0)
        b.synchronize(0)
        base = b.memory_stats(0).allocated
        b.reset_peak_memory(0)
        if mode != "keep":
            # A cap below what keeping everything needed: only the decision makes it fit.
            b.set_memory_cap(0, base + (results["keep"]["act_peak"] * 3) // 4 + (16 << 20))
        with b.device_scope(0):
            loss = lm_loss(stage(x), y)
            loss.backward()
        b.synchronize(0)
        b.set_memory_cap(0, None)
        results[mode] = {"loss": loss.item(), "act_peak": b.memory_stats(0).peak_allocated - base,
                         "grads": {n: p.grad.detach().cpu() for n, p in stage.named_parameters()}, "stats": ex.stats}
    keep, other = results["keep"], results[decision]
    assert abs(keep["loss"] - other["loss"]) < 1e-5
    for n, g in keep["grads"].items():
        torch.testing.assert_close(other["grads"][n], g, atol=1e-5, rtol=1e-4, msg=n)
    assert other["act_peak"] < keep["act_peak"]
    if decision == "host":
        assert other["stats"].bytes["host"] > 0 and other["stats"].swapped_in == other["stats"].bytes["host"]
    else:
        assert other["stats"].recompute_reruns == DIMS["layers"]
