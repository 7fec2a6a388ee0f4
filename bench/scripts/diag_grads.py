"""Per-parameter gradients of MemFerry against plain PyTorch on the same bf16 model and batch.

Diagnoses a loss trajectory that departs from the baselines' from the first update on: one
forward and backward of the bench GPT, MemFerry's host gradients (clipping on with a huge
norm, so updates wait and the gradients stay readable) against ``param.grad`` of a bf16 copy
of the model trained by plain autograd on the device. Prints the worst parameters.

    XPU_BACKEND=cuda python3 bench/scripts/diag_grads.py --layers 2 --plans prefetch,prefetch+recompute,dha
"""
from __future__ import annotations

import argparse
import copy

import torch

import xpu
from strategies.models import build_model
from strategies.memferry import AdamW, MemFerry, Plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--plans", default="prefetch,prefetch+recompute,dha")
    ap.add_argument("--loss-chunks", type=int, default=1)
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    b = xpu.get_backend()
    dev = b.device(0)
    torch.manual_seed(0)
    dims = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab, seq=a.seq)
    model = build_model("gpt", dtype=dt, **dims)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    ref = copy.deepcopy(model).to(dev)
    if a.loss_chunks > 1:
        ref.loss_chunks = a.loss_chunks
    ref_loss = ref(x.to(dev), y.to(dev))
    ref_loss.backward()
    want = {n: p.grad.detach().float().cpu() for n, p in ref.named_parameters()}
    del ref
    print(f"reference loss {float(ref_loss.detach()):.6f}; grad norm {torch.sqrt(sum(w.double().square().sum() for w in want.values())):.6e}")
    for spec in a.plans.split(","):
        m = copy.deepcopy(model)
        if a.loss_chunks > 1:
            m.loss_chunks = a.loss_chunks
        eng = MemFerry(m, optim=AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1e30), plan=Plan.from_spec(spec, a.layers), backend=b, device=0)
        loss = eng.train_step(x, y)
        eng.optimizer.grad_sqnorm()  # every host gradient has landed
        b.synchronize(0)
        got = {}
        for s in eng.shadow.shadows:
            src = s.grad_stage if s.home == "host" else None
            for (name, p), off in zip(s.unit.params, s.offsets):
                if src is not None:
                    got[name] = src[off:off + p.numel()].float().view(p.shape).cpu()
        rows = []
        for name, w in want.items():
            if name not in got:
                continue
            err = (got[name] - w).norm() / w.norm().clamp(min=1e-30)
            rows.append((float(err), name, float(got[name].norm()), float(w.norm())))
        rows.sort(reverse=True)
        print(f"\n{spec}: loss {float(loss):.6f}; engine grad norm {eng.last_grad_norm:.6e}; {len(rows)} params compared")
        for err, name, gn, wn in rows[:6]:
            print(f"  grad rel err {err:.3e}  {name:<40} |engine| {gn:.4e}  |ref| {wn:.4e}")
        # The first update: the engine's fp32 masters against torch's AdamW on the reference
        # gradients from the same fp32 start (the bf16 weights upcast).
        eng.step()
        state = eng.state_dict()["optimizer"]
        masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
        for n, t in masters.items():
            t.grad = want[n].clone()
        torch.optim.AdamW(list(masters.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
        upd = []
        for n, t in masters.items():
            start = dict(model.named_parameters())[n].detach().float()
            ref_step, got_step = t.detach() - start, state[n]["master"].float() - start
            err = (got_step - ref_step).norm() / ref_step.norm().clamp(min=1e-30)
            upd.append((float(err), n, float(got_step.norm()), float(ref_step.norm()), state[n]["step"]))
        upd.sort(reverse=True)
        for err, n, gn, wn, st in upd[:6]:
            print(f"  update rel err {err:.3e}  {n:<38} |engine| {gn:.4e}  |AdamW| {wn:.4e}  step {st}")
        eng.close()


if __name__ == "__main__":
    main()
