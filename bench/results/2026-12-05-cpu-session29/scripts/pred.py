import os; os.environ["XPU_BACKEND"]="cpu"
import torch, xpu, gc
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.planning import plan_for
from strategies.memferry.cost import links_from_probe, predict
from strategies.models import build_model
be = xpu.get_backend()
import sys
H = int(sys.argv[1]); T = int(sys.argv[2]); dt = torch.bfloat16 if sys.argv[3] == "bf16" else torch.float32
DIMS = dict(layers=4, hidden=H, heads=4, vocab=512, seq=T, bias=False)
def gpt():
    torch.manual_seed(0); return build_model("gpt", dtype=dt, **DIMS)
tok = torch.randint(0, 512, (8, T + 1), generator=torch.Generator().manual_seed(4))
x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
prof = plan_for(gpt(), (x, y), None, backend=be).profile
links = links_from_probe(be, 0)
b0 = prof.blocks[0]
print(f"H={H} T={T} {dt}: act {b0.act_bytes/1e6:.2f} MB, recompute {b0.act_bytes_recompute/1e6:.2f}, param {b0.param_bytes/1e6:.2f}, loss peak {prof.loss_peak_bytes/1e6:.2f}")
for name, up in [("prefetch", UnitPlan("prefetch", "prefetch")), ("prefetch+rc", UnitPlan("prefetch", "prefetch", recompute=True)),
                 ("resident", UnitPlan("resident", "resident")), ("offload", UnitPlan("prefetch", "prefetch", offload=True)),
                 ("dev-homed", UnitPlan("resident", "resident", optimizer="device"))]:
    plan = Plan.uniform(4, up); plan = Plan(plan.units, rest_optimizer="host")
    pred = predict(plan, prof, links, 0.0)
    gc.collect(); before = be.memory_stats(0).allocated
    eng = MemFerry(gpt(), optim=AdamW(lr=1e-3), plan=plan, backend=be)
    eng.train_step(x, y); be.synchronize(0); be.reset_peak_memory(0); eng.train_step(x, y); be.synchronize(0)
    got = be.memory_stats(0).peak_allocated - before
    eng.close()
    print(f"  {name:12s} predicted {pred.peak_bytes/1e6:7.2f}  measured {got/1e6:7.2f}  ratio {got/pred.peak_bytes:.3f}")
from strategies.memferry.scheduler import min_budget
mb = min_budget(prof, links, margin=0.0)
for f in (1.0, 1.2, 1.5, 2.0):
    plan = plan_for(gpt(), (x, y), int(mb * f), backend=be, memory_margin=0.0)
    pred = predict(plan, prof, links, 0.0)
    gc.collect(); before = be.memory_stats(0).allocated
    eng = MemFerry(gpt(), optim=AdamW(lr=1e-3), plan=plan, backend=be)
    eng.train_step(x, y); be.synchronize(0); be.reset_peak_memory(0); eng.train_step(x, y); be.synchronize(0)
    got = be.memory_stats(0).peak_allocated - before
    eng.close()
    print(f"  sched x{f}: rest {plan.rest_optimizer} depth {plan.prefetch_depth} predicted {pred.peak_bytes/1e6:7.2f} (plan says {plan.predicted_peak_bytes/1e6:.2f}) measured {got/1e6:7.2f}  ratio {got/pred.peak_bytes:.3f}")
    for i, u in enumerate(plan.units):
        print("     ", i, u.forward, u.backward, "rc" if u.recompute else "", "sel" if u.selective else "", "off" if u.offload else "", u.optimizer, u.accumulate)
