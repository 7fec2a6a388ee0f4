"""What LoRA adapters cost one decoder layer: forward and forward + backward of one HF decoder
layer, fully trainable, frozen with peft LoRA adapters, and frozen with the same adapters made
three other ways (experiments, here only): inside the base GEMM's reduction (``[x, s x A^T]
[W, B]^T``: no pass over the output beside the GEMM, its backward makes the input gradient of
both in one GEMM, but the input is copied), added into the base output in place (one GEMM with
``beta = 1``: one read and write of the output), and per linear whichever of the two copies
less (the input where it is the narrower side, else the output), and the same with the backward's
input gradient made on its narrower side too.

Default shape: Qwen2-1.5B's layer (hidden 1536, ffn 8960, 12 heads / 2 KV heads), 4 x 2048
tokens, bf16, LoRA r 16 on all seven linears (the qwen2-1.5b-finetune scenario's). Times are the
median of ``--iters`` runs between the backend's events (``xpu.timing``), after ``--warmup`` runs;
forward + backward is also timed with the device kept busy while it is issued
(``xpu.timing.pipelined_seconds``): the device's own time, and the host's time to issue it (where
the host's exceeds the device's, the layer is bound by issuing kernels, not by running them).
``--profile N`` adds each variant's N kernels that took longest in one forward + backward;
``--ops 1`` (the default) each piece of a LoRA linear timed alone for the layer's four shapes;
``--compile 1`` adds the fully trainable and the peft layer under ``torch.compile`` (and the
peft one with CUDA graphs too: ``mode="reduce-overhead"``), for a layer bound by issuing kernels.

    python3 bench/scripts/diag_lora_layer.py [--hidden 1536 --ffn 8960 --heads 12 --kv-heads 2]
        [--batch 4 --seq 2048 --r 16] [--iters 20] [--profile 12] [--ops 0] [--compile 1] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch


def _layer(args: argparse.Namespace, dev: torch.device) -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, num_hidden_layers=1, vocab_size=1024,
                                   max_position_embeddings=args.seq)
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen2ForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16)


def _saved(ctx, x, x2, xa, w, a, b, s, y):
    """What every variant's backward reads, kept; ``y`` in ``x``'s leading shape."""
    ctx.save_for_backward(x2, xa, w, a, b)
    ctx.s, ctx.shape = s, x.shape
    return y.view(*x.shape[:-1], w.shape[0])


def _grad_rows(ctx, g):
    """The saved tensors and the output gradient as rows."""
    return (*ctx.saved_tensors, g.reshape(-1, g.shape[-1]))


class _ConcatLora(torch.autograd.Function):
    """``x W^T + bias + s (x A^T) B^T`` as one GEMM over ``[x, s x A^T]`` and ``[W, B]``; W and bias frozen."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s):
        x2 = x.reshape(-1, x.shape[-1])
        xa = (x2 @ a.t()).mul_(s)
        xc, wc = torch.cat([x2, xa], 1), torch.cat([w, b], 1)
        y = xc @ wc.t() if bias is None else torch.addmm(bias, xc, wc.t())
        return _saved(ctx, x, x2, xa, w, a, b, s, y)

    @staticmethod
    def backward(ctx, g):
        x2, xa, w, a, b, g2 = _grad_rows(ctx, g)
        dxc = g2 @ torch.cat([w, b], 1)  # the base layer's input gradient and the adapter's, one GEMM
        dxa = dxc[:, w.shape[1]:]
        dx = torch.addmm(dxc[:, :w.shape[1]], dxa, a, alpha=ctx.s).view(ctx.shape)
        return dx, None, None, (dxa.t() @ x2).mul_(ctx.s), g2.t() @ xa, None


class _InplaceLora(torch.autograd.Function):
    """``x W^T + bias`` by one GEMM, then ``s (x A^T) B^T`` added into it in place (cuBLAS's
    ``beta = 1``: one read and one write of the output); W and bias frozen."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s):
        x2 = x.reshape(-1, x.shape[-1])
        y = x2 @ w.t() if bias is None else torch.addmm(bias, x2, w.t())
        xa = x2 @ a.t()
        y.addmm_(xa, b.t(), alpha=s)
        return _saved(ctx, x, x2, xa, w, a, b, s, y)

    @staticmethod
    def backward(ctx, g):
        x2, xa, w, a, b, g2 = _grad_rows(ctx, g)
        gb = (g2 @ b).mul_(ctx.s)
        dx = (g2 @ w).addmm_(gb, a)
        return dx.view(ctx.shape), None, None, gb.t() @ x2, (g2.t() @ xa).mul_(ctx.s), None


class _NarrowLora(torch.autograd.Function):
    """Each extra pass on the narrower side of the linear: forward as :class:`_ConcatLora` where
    the input is narrower than the output, else as :class:`_InplaceLora`; backward makes the
    input gradient as ``[g, s g B] [W; A]`` (one GEMM, ``g`` copied) where the output is the
    narrower side, else as ``g W`` with ``s (g B) A`` added in place."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s):
        ctx.xa_scaled = w.shape[1] < w.shape[0]  # the concatenated forward saves s x A^T
        return (_ConcatLora if ctx.xa_scaled else _InplaceLora).forward(ctx, x, w, bias, a, b, s)

    @staticmethod
    def backward(ctx, g):
        x2, xa, w, a, b, g2 = _grad_rows(ctx, g)
        gb = (g2 @ b).mul_(ctx.s)
        if w.shape[0] < w.shape[1]:
            dx = torch.cat([g2, gb], 1) @ torch.cat([w, a], 0)
        else:
            dx = (g2 @ w).addmm_(gb, a)
        db = g2.t() @ xa
        return dx.view(ctx.shape), None, None, gb.t() @ x2, db if ctx.xa_scaled else db.mul_(ctx.s), None


def _swap_lora(model: torch.nn.Module, pick) -> None:
    """Give each peft LoRA ``Linear`` (one adapter, no dropout) the forward of ``pick(in, out)``:
    an autograd function taking ``x, W, bias, A, B, scaling``."""
    from peft.tuners.lora import layer as lora_layer

    for m in model.modules():
        if type(m) is lora_layer.Linear:
            name, w = m.active_adapters[0], m.base_layer.weight
            fn = pick(w.shape[1], w.shape[0])
            m.forward = (lambda m, name, fn: lambda x, *args, **kw: fn.apply(
                x, m.base_layer.weight, m.base_layer.bias, m.lora_A[name].weight, m.lora_B[name].weight,
                float(m.scaling[name])))(m, name, fn)


def _op_table(timed_ms, dev: torch.device, tokens: int, r: int, shapes: list[tuple[str, int, int]]) -> list[str]:
    """Each piece of a LoRA linear's forward and backward timed alone, per linear shape."""
    ops = ["x W^T", "x A^T", "peft tail: B, *s, +", "addmm(y, xa, B^T)", "y.addmm_(xa, B^T)",
           "cat [x, xa]", "[x, xa] [W, B]^T", "g W (dX)", "g^T x (dW)", "g B", "(g B)^T x (dA)",
           "g^T xa (dB)", "dx.addmm_(gB, A)"]
    lines = ["| op | " + " | ".join(f"{n} {i}->{o}" for n, i, o in shapes) + " |",
             "|---|" + "---:|" * len(shapes)]
    cols = []
    for _, fan_in, fan_out in shapes:
        def t(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        x, w, a, b, g = t(tokens, fan_in), t(fan_out, fan_in), t(r, fan_in), t(fan_out, r), t(tokens, fan_out)
        y, xa, gb, dx = x @ w.t(), x @ a.t(), g @ b, g @ w
        xc, wc = torch.cat([x, xa], 1), torch.cat([w, b], 1)
        fns = [lambda: x @ w.t(), lambda: x @ a.t(), lambda: y + (xa @ b.t()) * 2.0,
               lambda: torch.addmm(y, xa, b.t(), alpha=2.0), lambda: y.addmm_(xa, b.t(), alpha=2.0),
               lambda: torch.cat([x, xa], 1), lambda: xc @ wc.t(), lambda: g @ w, lambda: g.t() @ x,
               lambda: g @ b, lambda: gb.t() @ x, lambda: g.t() @ xa, lambda: dx.addmm_(gb, a)]
        cols.append([timed_ms(f) for f in fns])
    lines += [f"| {op} | " + " | ".join(f"{c[k]:.3f}" for c in cols) + " |" for k, op in enumerate(ops)]
    return lines


def _gap(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Largest difference over the reference's largest magnitude."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _top_kernels(backend, fn, count: int) -> str:
    """The ``count`` device kernels that took longest in one call of ``fn`` (torch.profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    accelerated = [a for a in torch.profiler.supported_activities() if a != ProfilerActivity.CPU]
    with profile(activities=[ProfilerActivity.CPU, *accelerated]) as prof:
        fn()
        backend.synchronize(0)
    key = "self_device_time_total" if accelerated else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=count, max_name_column_width=70)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("hidden", 1536), ("ffn", 8960), ("heads", 12), ("kv-heads", 2), ("batch", 4), ("seq", 2048),
                          ("r", 16), ("iters", 20), ("warmup", 5), ("profile", 0), ("ops", 1), ("compile", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import peft

    import xpu
    from xpu.timing import median_event_seconds, pipelined_seconds

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
    concat, inplace, hybrid, narrow = (copy.deepcopy(lora) for _ in range(4))
    _swap_lora(concat, lambda i, o: _ConcatLora)
    _swap_lora(inplace, lambda i, o: _InplaceLora)
    # Per linear, the variant with the smaller extra pass: copying the input (concat) or the output (in place).
    _swap_lora(hybrid, lambda i, o: _ConcatLora if i < o else _InplaceLora)
    _swap_lora(narrow, lambda i, o: _NarrowLora)

    def layer_of(m: torch.nn.Module) -> torch.nn.Module:
        return next(mod for mod in m.modules() if type(mod).__name__.endswith("DecoderLayer"))

    rows, kernels = [], []
    grads, failed = {}, {}
    variants = [("full (trainable)", full, None), ("LoRA (peft)", lora, None), ("LoRA (concatenated K)", concat, None),
                ("LoRA (in-place addmm)", inplace, None), ("LoRA (hybrid)", hybrid, None),
                ("LoRA (narrow side)", narrow, None)]
    if args.compile:  # fewer launches and less Python per kernel: does it lift a host-bound layer?
        variants += [("full, torch.compile", copy.deepcopy(full), "default"),
                     ("LoRA (peft), torch.compile", copy.deepcopy(lora), "default"),
                     ("LoRA (peft), torch.compile + graphs", copy.deepcopy(lora), "reduce-overhead")]
    for label, m, mode in variants:
        layer = layer_of(m) if mode is None else torch.compile(layer_of(m), mode=mode)

        def fwd() -> torch.Tensor:
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are done with
            out = layer(x, position_embeddings=emb, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

        def fwd_bwd() -> None:
            if mode == "reduce-overhead":
                x.grad = None  # a sum into x.grad would read a replay's output after the next replay
            fwd().float().square().mean().backward()

        try:
            x.grad = None
            out = fwd()
            out.float().square().mean().backward()
            grads[label] = (out.detach().clone(), x.grad.clone(), [p.grad.clone() for n, p in m.named_parameters()
                                                                   if "lora_" in n and p.grad is not None])
            with torch.no_grad():
                t_f = timed_ms(fwd)
            t_fb = timed_ms(fwd_bwd)
            piped = [pipelined_seconds(backend, 0, stream, fwd_bwd, lead_s=0.2) for _ in range(args.iters)]
        except Exception as exc:  # one variant failing (a compiler's limits) leaves the others' rows
            failed[label] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            continue
        device_ms, host_ms = (1e3 * statistics.median(p[i] for p in piped) for i in (0, 1))
        rows.append((label, t_f, t_fb, t_fb - t_f, device_ms, host_ms))
        if args.profile:
            kernels.append((label, _top_kernels(backend, fwd_bwd, args.profile)))
    lines = [f"# One decoder layer: hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.kv_heads}, "
             f"{args.batch} x {args.seq} tokens, bf16, LoRA r {args.r} on {len(targets)} linears "
             f"({dev})",
             "", "| layer | forward ms | forward + backward ms | backward ms | fwd + bwd: device ms | host ms to issue |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {label} | {f:.3f} | {fb:.3f} | {b:.3f} | {d:.3f} | {h:.3f} |" for label, f, fb, b, d, h in rows]
    lines += [f"| {label} | failed: {why} | | | | |" for label, why in failed.items()]
    ref = grads["LoRA (peft)"]
    lines.append("")
    for label in [v[0] for v in variants if v[0].startswith("LoRA") and v[0] != "LoRA (peft)" and v[0] in grads
                  and v[0] not in failed]:
        got = grads[label]
        lines.append(f"- {label} against peft (largest difference over largest value): output {_gap(ref[0], got[0]):.1e}, "
                     f"input gradient {_gap(ref[1], got[1]):.1e}, adapter gradients "
                     f"{max(_gap(r, g) for r, g in zip(ref[2], got[2])):.1e} ({len(got[2])} tensors)")
    if args.ops:
        kv = args.hidden // args.heads * args.kv_heads
        shapes = [("q/o", args.hidden, args.hidden), ("k/v", args.hidden, kv), ("gate/up", args.hidden, args.ffn),
                  ("down", args.ffn, args.hidden)]
        lines += ["", f"## Each piece alone, ms ({args.batch * args.seq} tokens, r {args.r})", ""]
        lines += _op_table(timed_ms, dev, args.batch * args.seq, args.r, shapes)
    for label, table in kernels:
        lines += ["", f"## {label}: the longest kernels of one forward + backward", "", "```", table, "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
