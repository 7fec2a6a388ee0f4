"""Do MemFerry's compiled blocks run compiled inside its steps? (``compile_blocks``, session 56)

Session 56's LoRA row on the HF Qwen2-1.5B shape profiled its blocks at 5.4 ms compiled against
9.5 eager, predicted 1.69 s a step, and ran 3.04 s: what eager blocks take. This builds a few
decoder layers of that shape (random init, optional peft LoRA), trains them with MemFerry under a
named plan eagerly and with ``compile_blocks=True``, and prints for each: step times, what dynamo
compiled (its counters), why it skipped any frame of the model's code (dynamo's own log), and how
much of one step's device time ran in Triton kernels (torch.profiler). A compiled step that runs
no Triton kernel did not run its compiled graphs:

    python3 bench/scripts/diag_compiled_steps.py [--layers 4] [--plan prefetch+recompute|auto] [--lora] [--only-compiled]
"""
from __future__ import annotations

import argparse
import collections
import logging
import time

import torch


class _Skips(logging.Handler):
    """Dynamo's "skipping: FRAME (reason: ..., file: ...)" debug lines for model code, counted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("skipping") and ("transformers" in msg or "strategies" in msg):
            self.seen[msg.split(", file:")[0][:160]] += 1


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from strategies.models.hf import HFCausalLM

    torch.manual_seed(0)
    cfg = dict(model_type="qwen2", hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
               tie_word_embeddings=True)
    lora = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]} if args.lora else None
    return HFCausalLM(config=cfg, seq=args.seq, lora=lora).to(torch.bfloat16)  # peft's adapters come fp32


def _run(args: argparse.Namespace, compile_blocks: bool, skips: _Skips) -> dict:
    import xpu
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from strategies.memferry import AdamW, MemFerry
    from strategies.memferry.compiled_blocks import compiled_runs

    b = xpu.get_backend()
    counters.clear()
    skips.seen.clear()
    tok = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    sample = (x, y) if args.plan == "auto" else None
    engine = MemFerry(_model(args), optim=AdamW(lr=1e-4), plan=args.plan, sample=sample, backend=b, device=0,
                      compile_blocks=compile_blocks)
    runs0, times = compiled_runs(), []
    for _ in range(args.steps):
        b.synchronize(0)
        t0 = time.perf_counter()
        engine.train_step(x, y)
        b.synchronize(0)
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.train_step(x, y)
        b.synchronize(0)
    device_us = collections.Counter()
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" or us and not e.cpu_time_total:
            device_us["triton" if "triton" in e.key else "other"] += us
    engine.close()
    return {"compile": compile_blocks, "steps_ms": [round(t * 1e3, 1) for t in times],
            "compiled_runs": compiled_runs() - runs0, "predicted_ms": engine.plan.predicted_step_s and round(
                engine.plan.predicted_step_s * 1e3, 1),
            "stats": dict(counters["stats"]), "recompiles": dict(counters.get("recompiles", {})),
            "graph_breaks": dict(counters["graph_break"]), "skips": dict(skips.seen),
            "device_ms": {k: round(v / 1e3, 1) for k, v in device_us.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--plan", default="prefetch+recompute")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--only-compiled", action="store_true", help="skip the eager engine")
    args = ap.parse_args()
    skips = _Skips()
    torch._logging.set_logs(dynamo=logging.DEBUG)
    for name in ("torch._dynamo", "torch._dynamo.convert_frame"):
        logging.getLogger(name).addHandler(skips)
        logging.getLogger(name).propagate = False  # keep dynamo's debug lines out of the output
    for compile_blocks in (False, True)[1 if args.only_compiled else 0:]:
        row = _run(args, compile_blocks, skips)
        print(row, flush=True)


if __name__ == "__main__":
    main()
