"""Activation offload's peak against the memory model, on the cpu backend's exact accounting.

A GPT block saves q, k and v as slices of one ``qkv`` output; the swapper kept such views (and
with them the whole storage) while the profiler counted them as offloaded, and the model left out
what a block's backward makes beyond its weights' gradients. A uniform offload plan then peaked
1.09x its prediction here (1.15x at hidden 256), past the default 5 % margin."""
from __future__ import annotations

import gc

import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.planning import plan_for
from strategies.models import build_model

DIMS = dict(layers=3, hidden=128, heads=4, vocab=256, seq=64, bias=False)


def _gpt():
    torch.manual_seed(0)
    return build_model("gpt", dtype=torch.bfloat16, **DIMS)


def test_an_offload_plan_peaks_within_the_default_margin_of_its_prediction(cpu_backend):
    b = cpu_backend
    tok = torch.randint(0, DIMS["vocab"], (4, DIMS["seq"] + 1), generator=torch.Generator().manual_seed(4))
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    profile = plan_for(_gpt(), (x, y), None, backend=b).profile
    plan = Plan(Plan.uniform(DIMS["layers"], UnitPlan("prefetch", "prefetch", offload=True)).units, rest_optimizer="host")
    predicted = predict(plan, profile, links_from_probe(b, 0), 0.0).peak_bytes
    gc.collect()
    before = b.memory_stats(0).allocated
    engine = MemFerry(_gpt(), optim=AdamW(lr=1e-3), plan=plan, backend=b)
    engine.train_step(x, y)
    b.reset_peak_memory(0)
    engine.executor.swapper.stats.reset()
    engine.train_step(x, y)
    peak = b.memory_stats(0).peak_allocated - before
    stats = engine.executor.swapper.stats.as_dict()
    engine.close()
    # every saved activation of a block went out (no slice kept) and came back once
    assert stats["bytes"].get("keep", 0) == 0 and stats["swapped_in"] == stats["bytes"]["host"] > 0
    assert 0.9 * predicted <= peak <= 1.05 * predicted, (peak, predicted)
