"""Activation offload's peak against the memory model, on the cpu backend's exact accounting.

A GPT block saves q, k and v as slices of one ``qkv`` output; the swapper kept such views (and
with them the whole storage) while the profiler counted them as offloaded, and the model left out
what a block's backward makes beyond its weights' gradients. A uniform offload plan then peaked
1.09x its prediction here (1.15x at hidden 256), past the default 5 % margin.

Plans that keep the top block's activations over offloaded or recomputed blocks below it were
over-predicted (0.79x and 0.70x here): the model added every block's activations to the worst
backward transient, and counted every prefetch slot at the loss; when a lower block's backward
runs, the blocks above it have freed theirs, and forward's last load is all that is held at the
loss. A lone offloaded block was charged its look-ahead's bytes though no offloaded block lies
below it."""
from __future__ import annotations

import gc

import pytest
import torch

from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.planning import plan_for
from strategies.models import build_model

DIMS = dict(layers=3, hidden=128, heads=4, vocab=256, seq=64, bias=False)


def _gpt():
    torch.manual_seed(0)
    return build_model("gpt", dtype=torch.bfloat16, **DIMS)


def _batch():
    tok = torch.randint(0, DIMS["vocab"], (4, DIMS["seq"] + 1), generator=torch.Generator().manual_seed(4))
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _peaks(b, plan):
    """``(measured, predicted, swap counters)`` of ``plan``: the second step's peak of a fresh
    engine above what was allocated before it, the cost model's peak (margin 0) on the model's
    profile, and the engine's swap counters of that step."""
    x, y = _batch()
    predicted = predict(plan, plan_for(_gpt(), (x, y), None, backend=b).profile, links_from_probe(b, 0), 0.0).peak_bytes
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
    return peak, predicted, stats


def test_an_offload_plan_peaks_within_the_default_margin_of_its_prediction(cpu_backend):
    plan = Plan(Plan.uniform(DIMS["layers"], UnitPlan("prefetch", "prefetch", offload=True)).units, rest_optimizer="host")
    peak, predicted, stats = _peaks(cpu_backend, plan)
    # every saved activation of a block went out (no slice kept) and came back once
    assert stats["bytes"].get("keep", 0) == 0 and stats["swapped_in"] == stats["bytes"]["host"] > 0
    assert 0.9 * predicted <= peak <= 1.05 * predicted, (peak, predicted)


@pytest.mark.parametrize("below", ["offload", "recompute"])
def test_a_kept_top_block_over_lighter_ones_peaks_at_its_prediction(cpu_backend, below):
    light = UnitPlan("prefetch", "prefetch", offload=below == "offload", recompute=below == "recompute")
    plan = Plan([light] * (DIMS["layers"] - 1) + [UnitPlan("prefetch", "prefetch")], 1, "host")
    peak, predicted, _ = _peaks(cpu_backend, plan)
    assert 0.95 * predicted <= peak <= 1.05 * predicted, (peak / predicted, below)


def test_a_lone_offloaded_block_pays_for_no_look_ahead(cpu_backend):
    """Block 0 offloaded under recomputed blocks: no offloaded block lies below it, so its
    backward fetches its own activations only (charged two blocks' worth before: 0.71x its
    prediction here, 0.72x on Falcon's shape)."""
    recompute = UnitPlan("prefetch", "prefetch", recompute=True)
    plan = Plan([UnitPlan("prefetch", "prefetch", offload=True)] + [recompute] * (DIMS["layers"] - 1), 1, "host")
    peak, predicted, _ = _peaks(cpu_backend, plan)
    assert 0.95 * predicted <= peak <= 1.05 * predicted, peak / predicted
