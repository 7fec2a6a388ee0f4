"""Measured against predicted peak of 54 random mixed plans (6 per architecture) on the nine tiny
Hugging Face architectures of tests/test_hf_architectures.py (4 layers, hidden 64, 4 x 64 tokens,
fp32), cpu backend. Run from the repository root: PYTHONPATH=<checkout> python THIS."""
import os, sys, gc, random
os.environ["XPU_BACKEND"] = "cpu"
sys.path.insert(0, os.path.join(os.environ.get("PYTHONPATH", "."), "tests"))
import torch, xpu, transformers
from strategies.memferry import AdamW, MemFerry, Plan, UnitPlan
from strategies.memferry.planning import plan_for
from strategies.memferry.cost import links_from_probe, predict
from strategies.models import slice_hf_loss
from test_hf_architectures import ARCHS, _DROPOUTS
be = xpu.get_backend(); links = links_from_probe(be, 0)
L = 4
def tiny(mt):
    torch.manual_seed(0)
    extra = dict(ARCHS[mt]); 
    if mt == "gpt2": extra.update(n_embd=64, n_layer=L, n_positions=128)
    if mt == "opt": extra.update(ffn_dim=128, word_embed_proj_dim=64)
    if mt == "gemma2": extra.update(head_dim=16)
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
                **{k: 0.0 for k in _DROPOUTS}, **extra)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **dims)).float().train()
g = torch.Generator().manual_seed(1)
x = torch.randint(1, 256, (4, 64), generator=g)
CH = [UnitPlan("prefetch","prefetch"), UnitPlan("prefetch","prefetch",recompute=True), UnitPlan("prefetch","prefetch",offload=True),
      UnitPlan("resident","resident"), UnitPlan("resident","resident",optimizer="device"), UnitPlan("prefetch","prefetch",True,selective=True),
      UnitPlan("resident","resident",recompute=True,optimizer="device")]
rng = random.Random(0)
worst = []
for mt in sorted(ARCHS):
    prof = plan_for(slice_hf_loss(tiny(mt), 4), (x, x), None, backend=be).profile
    for trial in range(6):
        units = [rng.choice(CH) for _ in range(L)]
        plan = Plan(units, rng.choice([1, 2]), rng.choice(["host", "device"]))
        try:
            pred = predict(plan, prof, links, 0.0).peak_bytes
        except Exception as e:
            print(mt, "predict fail", e); continue
        gc.collect(); before = be.memory_stats(0).allocated
        try:
            eng = MemFerry(slice_hf_loss(tiny(mt), 4), optim=AdamW(lr=1e-3), plan=plan, backend=be)
            eng.train_step(x, x); be.synchronize(0); be.reset_peak_memory(0); eng.train_step(x, x); be.synchronize(0)
            got = be.memory_stats(0).peak_allocated - before
            eng.close()
        except Exception as e:
            print(mt, "run fail", type(e).__name__, str(e)[:100]); continue
        desc = ",".join(("r" if u.recompute and not u.selective else "s" if u.selective else "o" if u.offload else "k") + ("D" if u.optimizer=="device" else "") + ("R" if u.forward=="resident" else "") for u in units)
        print(f"{mt:8s} d{plan.prefetch_depth} rest-{plan.rest_optimizer:6s} {desc:28s} pred {pred/1e6:7.3f} got {got/1e6:7.3f} ratio {got/pred:.3f}", flush=True)
        worst.append((got/pred, mt, desc))
worst.sort()
print("lowest", worst[:3]); print("highest", worst[-5:])
