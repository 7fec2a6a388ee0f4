import os, logging, time
logging.basicConfig(level=logging.WARNING)
os.environ["XPU_BACKEND"] = "cpu"
import torch, xpu
from strategies.models import build_model
from strategies.memferry import AdamW, MemFerry
from strategies.memferry.batch_growth import scaled_profile
from strategies.memferry.cost import links_from_probe
from strategies.memferry.planning import plan_for
from strategies.memferry.scheduler import min_budget
b = xpu.get_backend()
import sys
H, S, L, B = [int(v) for v in sys.argv[1:5]]
dims = dict(layers=4, hidden=H, heads=4, vocab=256, seq=L, bias=False)
tok = torch.randint(0, 256, (B, L + 1), generator=torch.Generator().manual_seed(4))
short, long = (tok[:, :S], tok[:, 1:S + 1]), (tok[:, :-1].contiguous(), tok[:, 1:].contiguous())
def model():
    torch.manual_seed(0); return build_model("gpt", **dims)
t0 = time.time()
links = links_from_probe(b, 0)
profile = plan_for(model(), short, None, backend=b).profile
budget = int(1.5 * min_budget(scaled_profile(profile, B, L), links))
engine = MemFerry(model(), optim=AdamW(lr=1e-3), plan="auto", sample=short, device_budget=budget, backend=b)
engine.train_step(*short); engine.train_step(*long)
b.reset_peak_memory(0); engine.train_step(*long)
st = b.memory_stats(0)
print("peak", st.peak_allocated, "budget", budget, st.peak_allocated <= budget, f"{time.time()-t0:.1f}s")
engine.close()
