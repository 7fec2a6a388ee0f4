import os, sys, gc
os.environ["XPU_BACKEND"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))
import torch, transformers, xpu
from archs import cfg, ARCHS, data
from strategies.memferry import AdamW, MemFerry
be = xpu.get_backend()
def mk(mt):
    torch.manual_seed(0); return transformers.AutoModelForCausalLM.from_config(cfg(mt, **ARCHS[mt])).float()
batches = data(4); x0 = batches[0][0]
for mt, plan in (("opt", "resident3"), ("llama", "device3"), ("opt", "prefetch"), ("opt", "dha")):
    gc.collect(); gc.disable()
    eng = MemFerry(mk(mt), optim=AdamW(lr=1e-3, max_grad_norm=0.5), plan=plan if plan[-1].isalpha() else plan, accumulation_steps=2, backend=be)
    for i in range(0, 4, 2):
        for x, y in batches[i:i+2]:
            eng.backward(eng(input_ids=x, labels=y).loss / 2)
        eng.step()
    a0 = be.memory_stats(0).allocated
    eng.close()
    a1 = be.memory_stats(0).allocated
    del eng
    a2 = be.memory_stats(0).allocated
    gc.enable(); gc.collect()
    a3 = be.memory_stats(0).allocated
    print(mt, plan, "in use", a0, "after close", a1, "after del", a2, "after gc", a3)
