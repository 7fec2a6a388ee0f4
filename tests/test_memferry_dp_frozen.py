"""Frozen parameters under data-parallel MemFerry (LoRA-style runs): two ranks (gloo, cpu backend)
train exactly like one process on both micro-batches, and no rank keeps optimizer state for frozen ones."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies.memferry import AdamW, MemFerry
from strategies.weight_decay import param_groups
from xpu.dist import free_port
from tests.test_memferry_frozen import PLANS, frozen_model
from tests.test_memferry_numerics import lm_loss

STEPS, WORLD, ACCUM = 4, 2, 2
CFG = dict(lr=3e-3, weight_decay=0.1)


def lora_like():
    """``frozen_model`` with block 3's large weights frozen too (its trainable prefix falls in rank 0's shard)."""
    model = frozen_model()
    for p in (model.blocks[3].qkv.weight, model.blocks[3].mlp[0].weight, model.blocks[3].mlp[2].weight):
        p.requires_grad_(False)
    return model


def _data(seed=7):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 64, (2 * WORLD, 16), generator=g), torch.randint(0, 64, (2 * WORLD, 16), generator=g))
             for _ in range(ACCUM)] for _ in range(STEPS)]


CASES = [("prefetch", 0.05), ("dha", None), ("device", 0.05)]


def _rank(rank, port, out_dir):
    """Every case's two-rank run in one process group, one after another: a rank process
    (spawn, torch import, rendezvous) costs more than a run."""
    os.environ.update(XPU_BACKEND="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), XPU_COLLECTIVE_TIMEOUT_S="60")
    import xpu

    xpu.reset_backend()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for case, (plan_name, clip) in enumerate(CASES):
        engine = MemFerry(lora_like(), optim=AdamW(**CFG, max_grad_norm=clip), plan=PLANS[plan_name](4),
                          loss_fn=lm_loss, device=rank, accumulation_steps=ACCUM)
        half = 2
        for micro in _data():
            for x, y in micro:  # each rank trains on its own half of every micro-batch
                engine.backward(lm_loss(engine(x[rank * half:(rank + 1) * half]), y[rank * half:(rank + 1) * half])
                                / ACCUM)
            engine.step()
        state = engine.state_dict()
        host = [(s.unit.numel, s.unit.train_numel, s.master.numel()) for s in engine.shadow.shadows if s.home == "host"]
        engine.close()
        torch.save({"model": state["model"], "optimizer": state["optimizer"], "host": host},
                   os.path.join(out_dir, f"rank{rank}-case{case}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    """The folder the two ranks of :func:`_rank` wrote every case's results to."""
    out = tmp_path_factory.mktemp("dp_frozen")
    ctx = mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn", join=False)
    while not ctx.join(timeout=120):
        pass
    return out


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{p}-{c}" for p, c in CASES])
def test_two_ranks_with_frozen_parameters_equal_one_process(ranks_out, case):
    plan_name, clip = CASES[case]
    model = lora_like()
    opt = torch.optim.AdamW(param_groups(model, CFG["weight_decay"]), lr=CFG["lr"])
    for micro in _data():
        opt.zero_grad()
        for x, y in micro:
            (lm_loss(model(x), y) / ACCUM).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()

    ranks = [torch.load(ranks_out / f"rank{r}-case{case}.pt") for r in range(WORLD)]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for name, want in model.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["model"][name], want.detach(), atol=1e-5, rtol=1e-5, msg=name)
    for r in ranks:
        assert frozen and not frozen & set(r["optimizer"])  # no optimizer state for frozen parameters
    # optimizer shards cover the trainable prefix only: together exactly once
    for unit in zip(*(r["host"] for r in ranks)):
        assert sum(master for _, _, master in unit) == unit[0][1]
    # some unit's trainable prefix lies wholly in rank 0's shard (rank 1 holds frozen weights only)
    assert any(unit[0][1] and unit[1][2] == 0 for unit in zip(*(r["host"] for r in ranks)))
