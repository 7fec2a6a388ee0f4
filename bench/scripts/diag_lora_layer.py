"""What LoRA adapters cost one decoder layer: forward and forward + backward of one HF decoder
layer, fully trainable, frozen with peft LoRA adapters, and frozen with the same adapters on the
fused path (``strategies.models.fuse_lora``).

Default shape: Qwen2-1.5B's layer (hidden 1536, ffn 8960, 12 heads / 2 KV heads), 4 x 2048
tokens, bf16, LoRA r 16 on all seven linears (the qwen2-1.5b-finetune scenario's). Times are the
median of ``--iters`` runs between the backend's events (``xpu.timing``), after ``--warmup`` runs.

    python3 bench/scripts/diag_lora_layer.py [--hidden 1536 --ffn 8960 --heads 12 --kv-heads 2]
        [--batch 4 --seq 2048 --r 16] [--iters 20] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import copy

import torch


def _layer(args: argparse.Namespace, dev: torch.device) -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, num_hidden_layers=1, vocab_size=1024,
                                   max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen2ForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("hidden", 1536), ("ffn", 8960), ("heads", 12), ("kv-heads", 2), ("batch", 4), ("seq", 2048),
                          ("r", 16), ("iters", 20), ("warmup", 5)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import peft

    import xpu
    from strategies.models import fuse_lora
    from xpu.timing import median_event_seconds

    backend = xpu.get_backend()  # XPU_BACKEND, else the machine's accelerator, else cpu
    dev = backend.device(0)
    stream = backend.current_stream(dev)

    def timed_ms(fn) -> float:
        return 1e3 * median_event_seconds(backend, stream, fn, repeats=args.iters, warmup=args.warmup)

    base = _layer(args, dev)
    rotary = base.model.rotary_emb
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.batch, -1)
    emb = rotary(x, pos)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    full = copy.deepcopy(base)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=args.r, lora_alpha=2 * args.r,
                                                                     target_modules=targets, init_lora_weights=False))
    lora = lora.to(dtype=torch.bfloat16)
    fused = copy.deepcopy(lora)
    fuse_lora(fused)

    def layer_of(m: torch.nn.Module) -> torch.nn.Module:
        return next(mod for mod in m.modules() if type(mod).__name__.endswith("DecoderLayer"))

    rows = []
    for label, m in [("full (trainable)", full), ("LoRA (peft)", lora), ("LoRA (fused)", fused)]:
        layer = layer_of(m)

        def fwd() -> torch.Tensor:
            out = layer(x, position_embeddings=emb, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

        def fwd_bwd() -> None:
            fwd().float().square().mean().backward()

        with torch.no_grad():
            t_f = timed_ms(fwd)
        t_fb = timed_ms(fwd_bwd)
        rows.append((label, t_f, t_fb, t_fb - t_f))
    lines = [f"# One decoder layer: hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}, "
             f"{args.batch} x {args.seq} tokens, bf16, LoRA r {args.r} on {len(targets)} linears "
             f"({dev})",
             "", "| layer | forward ms | forward + backward ms | backward ms |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {f:.3f} | {fb:.3f} | {b:.3f} |" for label, f, fb, b in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
