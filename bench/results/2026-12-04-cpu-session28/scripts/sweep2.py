"""Sweep 2: tied embeddings, LoRA all-linear, padded batches with attention_mask, growing sequence lengths."""
import copy, os, sys, traceback
os.environ.setdefault("XPU_BACKEND", "cpu")
import torch, transformers, peft
import xpu
from strategies.memferry import AdamW, MemFerry
from strategies.weight_decay import param_groups
from strategies.models import slice_hf_loss
sys.path.insert(0, os.path.dirname(__file__))
from archs import cfg, ARCHS, V

def batches(n, b=2, lens=(16,), pad=False):
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(n):
        t = lens[i % len(lens)]
        x = torch.randint(1, V, (b, t), generator=g)
        mask = torch.ones_like(x)
        if pad:
            mask[0, : t // 4] = 0  # left padding on row 0
        y = x.masked_fill(mask == 0, -100)
        out.append((x, mask, y))
    return out

def reference(model, data, opt_cfg, accum, clip):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, opt_cfg.weight_decay), lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps)
    for i in range(0, len(data), accum):
        opt.zero_grad()
        for x, m, y in data[i:i + accum]:
            (model(input_ids=x, attention_mask=m, labels=y).loss / accum).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

def run(mt, v):
    torch.manual_seed(0)
    kw = dict(ARCHS[mt]); kw["tie_word_embeddings"] = v.get("tied", False)
    model = transformers.AutoModelForCausalLM.from_config(cfg(mt, **kw)).float()
    if v.get("lora"):
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    accum, clip = 2, 0.5
    opt_cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    data = batches(4, lens=v.get("lens", (16,)), pad=v.get("pad", False))
    ref = reference(model, data, opt_cfg, accum, clip)
    m = copy.deepcopy(model)
    if v.get("slice"):
        m = slice_hf_loss(m, 4)
    x0, m0, y0 = data[0]
    eng = MemFerry(m, optim=opt_cfg, accumulation_steps=accum, backend=xpu.get_backend(), plan="auto",
                   sample=(x0, y0), device_budget=v.get("budget", "2MB"))
    try:
        for i in range(0, len(data), accum):
            for x, mk, y in data[i:i + accum]:
                eng.backward(eng(input_ids=x, attention_mask=mk, labels=y).loss / accum)
            eng.step()
        state = eng.state_dict()["model"]
    finally:
        eng.close()
    return max(((state[n] - p).abs().max().item(), n) for n, p in ref.items())

VARIANTS = {
  "tied": {"tied": True},
  "tied+slice": {"tied": True, "slice": True},
  "lora": {"lora": True},
  "lora+slice": {"lora": True, "slice": True},
  "pad+slice": {"pad": True, "slice": True},
  "growing": {"lens": (8, 8, 32, 32), "slice": True},
}
if __name__ == "__main__":
    names = sys.argv[1:] or ["llama", "qwen2", "gpt2", "falcon", "gemma2", "phi3", "mixtral", "gpt_neox", "opt", "bloom"]
    only = os.environ.get("ONLY")
    for mt in names:
        for vn, v in VARIANTS.items():
            if only and vn != only: continue
            try:
                w, n = run(mt, v)
                print(f"{'OK ' if w < 1e-4 else 'BAD'} {mt:10s} {vn:11s} dparam {w:.2e} ({n})", flush=True)
            except Exception as e:
                print(f"ERR {mt:10s} {vn:11s} {type(e).__name__}: {str(e).splitlines()[0][:220] if str(e) else ''}", flush=True)
                if os.environ.get("TB"): traceback.print_exc()
