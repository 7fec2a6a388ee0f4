"""Each host-homed unit's fp32 master holds exactly its rank's shard of the pre-cast originals.

The shadow copies each parameter's part of the shard straight into the master (no padded fp32
temporary), so shards that begin or end inside a parameter, frozen parameters after the
trainable ones and padding past the unit's end are where it could go wrong.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from strategies.memferry.compute_dtype import cast_parameters
from strategies.memferry.data_parallel import DataParallel
from strategies.memferry.shadow import ShadowModel
from strategies.memferry.units import split_units


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width + 1)  # odd sizes: shard edges fall inside parameters
        self.b = nn.Linear(width + 1, width)
        self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(5) for _ in range(2))
        self.head = nn.Linear(5, 3)


class _Shards(DataParallel):
    """Only the sharding arithmetic of :class:`DataParallel`: rank ``rank`` of ``world``."""

    def __init__(self, rank: int, world: int) -> None:  # no process group: nothing is exchanged here
        self.rank, self.world = rank, world


@pytest.mark.parametrize("world", [1, 3, 4])
def test_masters_are_each_ranks_shard_of_the_fp32_originals(cpu_backend, world):
    torch.manual_seed(0)
    expected_flat = {}
    for rank in range(world):
        model = _Model()
        fp32 = {name: p.detach().clone() for name, p in model.named_parameters()}
        originals = cast_parameters(model, torch.bfloat16)
        units = split_units(model, model.blocks)
        dp = _Shards(rank, world) if world > 1 else None
        shadow = ShadowModel(units, cpu_backend, 0, dp=dp, originals=originals)
        for s in shadow.shadows:
            # the unit's trainable parameters, flat in the unit's order, then its shard of them
            flat = torch.cat([fp32[name].reshape(-1) for name, _ in s.unit.trainable])
            expected_flat.setdefault(s.unit.index, flat)
            shard = dp.shard(s.unit.numel)[1] if dp is not None else slice(0, s.unit.train_numel)
            want = flat[min(shard.start, flat.numel()):min(shard.stop, flat.numel())]
            # a local: a failing assert's report would repr the shadow, whose parameters view freed storage
            master, unit = s.master, s.unit.name
            assert master.dtype == torch.float32
            assert torch.equal(master, want), (rank, unit)
            # bit-exact from the fp32 original, not from the bf16 working copy
            assert want.numel() and not torch.equal(master, want.bfloat16().float())
        shadow.release()
    assert len(expected_flat) == 3  # two blocks and the rest unit
