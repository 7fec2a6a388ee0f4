"""Robustness sweep: tiny HF models of many architectures through MemFerry vs torch AdamW."""
import copy, sys, traceback
import torch, transformers
import xpu
from strategies.memferry import AdamW, MemFerry
from strategies.weight_decay import param_groups
from strategies.models import slice_hf_loss

V = 128
def cfg(mt, **kw):
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(kw)
    base.setdefault('pad_token_id', 0)
    for k in ('dropout','attention_dropout','hidden_dropout','resid_pdrop','embd_pdrop','attn_pdrop','activation_dropout','attn_dropout','hidden_dropout_prob','attention_probs_dropout_prob','embedding_dropout','summary_first_dropout','resid_dropout','mlp_dropout','emb_pdrop','ffn_dropout'):
        base[k] = 0.0
    return transformers.AutoConfig.for_model(mt, **base)

ARCHS = {
 "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 8}, "mistral": {}, "gemma": {"head_dim": 8}, "gemma2": {"head_dim": 8},
 "gemma3_text": {"head_dim": 8}, "phi3": {"pad_token_id": 0}, "phi": {}, "olmo": {}, "olmo2": {}, "stablelm": {}, "starcoder2": {},
 "granite": {}, "cohere": {}, "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
 "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
 "gpt2": {"n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}, "gpt_neox": {}, "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
 "falcon": {}, "bloom": {"n_head": 4}, "gptj": {"n_embd": 32, "n_layer": 3, "n_head": 4, "rotary_dim": 4, "n_positions": 64},
 "gpt_bigcode": {"n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}, "smollm3": {}, "glm": {"head_dim": 8},
}

def data(n, b=2, t=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (b, t), generator=g),) * 2 for _ in range(n)]

def reference(model, batches, opt_cfg, accum, clip):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model, opt_cfg.weight_decay), lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps)
    losses = []
    for i in range(0, len(batches), accum):
        opt.zero_grad()
        tot = 0.0
        for x, y in batches[i:i + accum]:
            loss = model(x, labels=y).loss / accum
            loss.backward(); tot += loss.item()
        if clip: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(); losses.append(tot)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

def run(mt, variant):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg(mt, **ARCHS[mt])).float()
    accum, clip = 2, 0.5
    opt_cfg = AdamW(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    batches = data(4)
    ref_losses, ref = reference(model, batches, opt_cfg, accum, clip)
    m = copy.deepcopy(model)
    if variant.get("slice"):
        m = slice_hf_loss(m, 4)
    x0 = batches[0][0]
    kw = dict(plan="auto", sample=(x0, x0), device_budget=variant["budget"]) if variant.get("budget") else dict(plan=variant["plan"])
    eng = MemFerry(m, optim=opt_cfg, accumulation_steps=accum, backend=xpu.get_backend(), **kw)
    losses = []
    for i in range(0, len(batches), accum):
        tot = 0.0
        for x, y in batches[i:i + accum]:
            loss = eng(input_ids=x, labels=y).loss / accum
            eng.backward(loss); tot += float(loss)
        eng.step(); losses.append(tot)
    state = eng.state_dict()["model"]
    eng.close()
    worst = max(((state[n] - p).abs().max().item(), n) for n, p in ref.items())
    dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return dl, worst

VARIANTS = {
  "prefetch": {"plan": None},
  "dha": {"plan": "dha"},
  "auto": {"budget": "2MB"},
  "auto+slice": {"budget": "2MB", "slice": True},
}
if __name__ == "__main__":
    import os
    os.environ.setdefault("XPU_BACKEND", "cpu")
    names = sys.argv[1:] or list(ARCHS)
    for mt in names:
        for vn, v in VARIANTS.items():
            try:
                vv = dict(v)
                if vn in ("prefetch", "dha"):
                    vv["plan"] = vn
                dl, (w, n) = run(mt, vv)
                flag = "OK " if dl < 1e-4 and w < 1e-4 else "BAD"
                print(f"{flag} {mt:14s} {vn:11s} dloss {dl:.2e} dparam {w:.2e} ({n})", flush=True)
            except Exception as e:
                print(f"ERR {mt:14s} {vn:11s} {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
                if os.environ.get("TB"): traceback.print_exc()
