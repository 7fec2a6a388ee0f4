"""Peaks of 55 random plans on a tiny Llama trained on left-padded batches (attention_mask), against
the predictions of a profile made on the token ids alone and of one made on the padded sample.
Run from the repository root: PYTHONPATH=. python THIS llama 55"""
import sys, os, gc, copy, random
os.environ["XPU_BACKEND"] = "cpu"
sys.path.insert(0, "bench/results/2026-12-04-cpu-session28/scripts")
import torch, transformers, xpu
from archs import cfg, ARCHS
import sweep2
from strategies.memferry import AdamW, MemFerry, Plan
from strategies.memferry.planning import plan_for
from strategies.memferry.cost import links_from_probe, predict
from strategies.memferry.scheduler import unit_choices
from strategies.models import slice_hf_loss
be = xpu.get_backend(); links = links_from_probe(be, 0)
mt = sys.argv[1]
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg(mt, **dict(ARCHS[mt]), tie_word_embeddings=False)).float()
data = sweep2.batches(4, pad=True)
x0, m0, y0 = data[0]
profs = {k: plan_for(slice_hf_loss(copy.deepcopy(model), 4), s, None, backend=be).profile
         for k, s in (("plain", (x0, y0)), ("masked", ({"input_ids": x0, "attention_mask": m0}, y0)))}
CH = unit_choices(device_sum=True)
rng = random.Random(0)
opt_cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
ratios = {"plain": [], "masked": []}
for trial in range(int(sys.argv[2])):
    units = [rng.choice(CH) for _ in range(len(profs["plain"].blocks))]
    plan = Plan(units, rng.choice([1, 2]), rng.choice(["host", "device"]))
    gc.collect(); before = be.memory_stats(0).allocated
    eng = MemFerry(slice_hf_loss(copy.deepcopy(model), 4), optim=opt_cfg, accumulation_steps=2, plan=plan, backend=be)
    try:
        for i in range(0, 4, 2):
            if i == 2:
                be.synchronize(0); be.reset_peak_memory(0)
            for x, mk, y in data[i:i + 2]:
                eng.backward(eng(input_ids=x, attention_mask=mk, labels=y).loss / 2)
            eng.step()
        be.synchronize(0)
        got = be.memory_stats(0).peak_allocated - before
    finally:
        eng.close()
    for k, prof in profs.items():
        prof.accumulation_steps = 2; prof.clipping = True
        ratios[k].append(got / predict(plan, prof, links, 0.0).peak_bytes)
for k, r in ratios.items():
    r.sort(); print(mt, k, "min %.3f median %.3f max %.3f n %d" % (r[0], r[len(r) // 2], r[-1], len(r)))
