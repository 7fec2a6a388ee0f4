"""Plan names and unit discovery."""
from __future__ import annotations

import pytest
from torch import nn

from strategies.memferry import Plan, UnitPlan, find_blocks, split_units


@pytest.mark.parametrize("spec, depth, first, last, rest", [
    ("prefetch", 1, UnitPlan("prefetch", "prefetch"), UnitPlan("prefetch", "prefetch"), "host"),
    ("prefetch3+recompute", 3, UnitPlan("prefetch", "prefetch", True), UnitPlan("prefetch", "prefetch", True), "host"),
    ("dha", 1, UnitPlan("dha", "dha"), UnitPlan("dha", "dha"), "host"),
    ("resident2", 1, UnitPlan("resident", "resident"), UnitPlan("prefetch", "prefetch"), "host"),
    ("device3+recompute", 1, UnitPlan("resident", "resident", True, "device"), UnitPlan("prefetch", "prefetch", True), "device"),
    ("device4", 1, UnitPlan("resident", "resident", optimizer="device"), UnitPlan("resident", "resident", optimizer="device"), "device"),
])
def test_plan_names(spec, depth, first, last, rest):
    plan = Plan.from_spec(spec, 4)
    assert len(plan.units) == 4 and plan.prefetch_depth == depth and plan.rest_optimizer == rest
    assert plan.units[0] == first and plan.units[-1] == last
    assert "optimizer=" in plan.describe()


@pytest.mark.parametrize("spec", ["device5", "prefetch0", "resident", "disk", "dha2", "prefetch+recompute+recompute"])
def test_bad_plan_names_list_the_valid_ones(spec):
    with pytest.raises(ValueError, match=r"write prefetch\[N\], dha, residentN or deviceN \(N from 0 to 4\)"):
        Plan.from_spec(spec, 4)


def test_units_follow_the_block_list_and_put_the_rest_last():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.small = nn.ModuleList([nn.ReLU(), nn.ReLU()])
            self.head = nn.Linear(4, 10)
            self.head.weight = self.emb.weight  # tied: one parameter, counted once

    net = Net()
    name, blocks = find_blocks(net)
    assert name == "layers" and blocks is net.layers
    units = split_units(net)
    assert [u.name for u in units] == ["layers.0", "layers.1", "layers.2", "rest"]
    assert [n for n, _ in units[-1].params] == ["emb.weight", "head.bias"]
    with pytest.raises(ValueError, match="found no repeated blocks in Sequential"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
