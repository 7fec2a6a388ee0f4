"""MemFerry on one accelerator (``pytest -m gpu``): every block plan trains like the
mixed-precision AdamW loop written out in plain PyTorch, on the device, in bf16.

Covers what the cpu backend cannot show: real pinned memory and copy streams, DHA linears
streaming through the copy engine (M above the in-place threshold) with gradients written into
host memory by the device, activation offload over the link, device-homed units.
"""
from __future__ import annotations

import copy

import pytest
import torch

from strategies.models import build_model
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from test_memferry_numerics import mixed_precision_reference

pytestmark = pytest.mark.gpu

# Hidden 256: MLP weights of 256 KiB in bf16, above the executor's 64 KiB routing floor; 8 x 64
# tokens = M 512, above host_linear's in-place threshold, so DHA blocks stream.
DIMS = dict(layers=4, hidden=256, heads=4, vocab=512, seq=64, bias=False)
BATCH, STEPS = 8, 5



PLANS = {
    "prefetch+recompute": Plan.uniform(4, UnitPlan("prefetch", "prefetch", recompute=True)),
    "dha-streamed": Plan([UnitPlan("dha", "dha"), UnitPlan("dha", "prefetch", recompute=True),
                          UnitPlan("dha", "dha", offload=True), UnitPlan("prefetch", "prefetch")]),
    "offload": Plan.uniform(4, UnitPlan("prefetch", "prefetch", offload=True)),
    "device-homed": Plan([UnitPlan("resident", "resident", optimizer="device"),
                          UnitPlan("resident", "resident", recompute=True, optimizer="device"),
                          UnitPlan("resident", "resident"), UnitPlan("prefetch", "prefetch")], rest_optimizer="device"),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plans_train_like_mixed_precision_adamw_on_the_device(gpu_backend, name):
    b = gpu_backend
    torch.manual_seed(0)
    model = build_model("gpt", dtype=torch.bfloat16, **DIMS)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, DIMS["vocab"], (BATCH, DIMS["seq"] + 1), generator=g)
    x, y = b.to_device(tok[:, :-1].contiguous(), 0), b.to_device(tok[:, 1:].contiguous(), 0)
    ref_losses, ref_masters = mixed_precision_reference(model, x, y, STEPS, lr=1e-3, weight_decay=0.1,
                                                        device=b.device(0))
    engine = MemFerry(copy.deepcopy(model), optim=AdamW(lr=1e-3, weight_decay=0.1), plan=PLANS[name], backend=b, device=0)
    losses = [float(engine.train_step(x, y)) for _ in range(STEPS)]
    state = engine.state_dict()["optimizer"]
    ex = engine.executor
    counter, swapped = ex.dha_counter, ex.swapper.stats.as_dict()
    engine.close()
    # bf16 forward/backward in a different kernel order (streamed chunks, recompute): agree to
    # bf16 rounding, over 5 updates
    assert losses == pytest.approx(ref_losses, abs=3e-2)
    for (pname, _), master in zip(model.named_parameters(), ref_masters):
        torch.testing.assert_close(state[pname]["master"], master, atol=5e-3, rtol=0, msg=pname)
    if name == "dha-streamed":
        assert counter.modes.get("stream/forward", 0) > 0 and counter.modes.get("stream/backward", 0) > 0
        # at 8 x 64 tokens the weights stream, and their gradients go home through the copy ring
        assert counter.d2h_bytes > 0 and counter.dha_write_bytes == 0
    if name in ("offload", "dha-streamed"):
        assert swapped["bytes"].get("host", 0) > 0 and swapped["swapped_in"] == swapped["bytes"]["host"]
