"""The docs/design.md §3 baselines as bare scripts, outside the harness, to check what it adds.

    python3 bench/scripts/diag_bare_baselines.py z2|z3|fsdp2 [--steps 5 --warmup 2]

Builds the same GPT (24 x 2048, vocab 32000, batch 8 x 1024, bf16) and trains it with
DeepSpeed ZeRO-2 / ZeRO-3 offload or FSDP2 + CPUOffloadPolicy configured exactly as
docs/design.md §3 lists, timing each step between device synchronisations: no worker process,
no host-memory sampler, no progress lines, no profiler labels. Run it beside ``xpu bench``
in one lease: if both give the same step time, the harness adds nothing and any gap to the
anchors is the machine's. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from strategies.models import build_model

DIMS = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 1024}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, DIMS["vocab"], (8, DIMS["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous().cuda(), tok[:, 1:].contiguous().cuda()


def deepspeed_step(stage: int):
    import deepspeed

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(k, v)
    cfg = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "overlap_comm": True, "contiguous_gradients": True},
           "optimizer": {"type": "AdamW"}, "steps_per_print": 10**9}
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build_model("gpt", **DIMS)
    else:
        model = build_model("gpt", device="cpu", dtype=torch.float32, **DIMS)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def fsdp2_step():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    model = build_model("gpt", device="cpu", dtype=torch.float32, **DIMS)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["z2", "z3", "fsdp2"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    step = fsdp2_step() if args.system == "fsdp2" else deepspeed_step(3 if args.system == "z3" else 2)
    setup = time.perf_counter() - t0
    x, y = batch()
    times = []
    for _ in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    timed = times[args.warmup:]
    print(json.dumps({"bare": args.system, "step_s": round(statistics.median(timed), 4),
                      "step_mean_s": round(statistics.fmean(timed), 4), "times": [round(t, 4) for t in times],
                      "setup_s": round(setup, 1), "torch_threads": torch.get_num_threads(),
                      "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
