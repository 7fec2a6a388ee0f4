import os; os.environ["XPU_BACKEND"]="cpu"
import torch, xpu
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.planning import plan_for
from strategies.memferry.cost import links_from_probe, predict
from strategies.models import build_model
be = xpu.get_backend()
H, T = 256, 64
DIMS = dict(layers=4, hidden=H, heads=4, vocab=512, seq=T, bias=False)
def gpt():
    torch.manual_seed(0); return build_model("gpt", dtype=torch.bfloat16, **DIMS)
tok = torch.randint(0, 512, (8, T + 1), generator=torch.Generator().manual_seed(4))
x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
prof = plan_for(gpt(), (x, y), None, backend=be).profile
links = links_from_probe(be, 0)
b0 = prof.blocks[0]
print("act", b0.act_bytes, "kept", b0.act_bytes_offload_kept, "loss", prof.loss_peak_bytes, "params", b0.param_bytes, "rest", prof.rest_param_bytes)
for up in (UnitPlan("prefetch", "prefetch", offload=True), UnitPlan("prefetch", "prefetch")):
    plan = Plan(Plan.uniform(4, up).units, rest_optimizer="host")
    pred = predict(plan, prof, links, 0.0)
    eng = MemFerry(gpt(), optim=AdamW(lr=1e-3), plan=plan, backend=be)
    eng.train_step(x, y); be.synchronize(0)
    base = be.memory_stats(0).allocated
    be.reset_peak_memory(0)
    loss = eng._loss(x, y)
    f_peak = be.memory_stats(0).peak_allocated; after_f = be.memory_stats(0).allocated
    be.reset_peak_memory(0)
    eng.backward(loss); eng.step(); be.synchronize(0)
    b_peak = be.memory_stats(0).peak_allocated
    print(f"offload={up.offload}: base {base/1e6:.2f} fwd peak {f_peak/1e6:.2f} after fwd {after_f/1e6:.2f} bwd peak {b_peak/1e6:.2f}  predicted {pred.peak_bytes/1e6:.2f}  parts", {k: round(v/1e6, 2) if v > 1000 else v for k, v in pred.parts.items() if 'byte' in k or 'peak' in k})
    eng.close()
