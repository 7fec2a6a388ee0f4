"""Diagnostic: the profiler's block and rest timings, alone and issued ahead, round by round.

    python3 bench/scripts/diag_profile_noise.py [--hidden 2048] [--rounds 8] [--repeats 3]

MemFerry's scheduler prices every identical block with one block's timings. Timed alone (events
around the pass) the §3 block's forward read 1.38-1.60 ms across H200 runs (2026-11-29 .. 12-03),
and, issued ahead (``profiler._timed`` with a lead: the device kept busy first so that the host
issues the whole pass before the device reaches it; the longer of device and host time), 1.33.
The profiler now times a forward alone and a backward and a recomputation issued ahead (its
module docstring says why). This prints, per round of ``--repeats`` (median), every pass both
ways: the block's forward and backward, and the ``rest`` unit's (embeddings, head, the loss in 8
recomputed slices; vocab 32000), from a cold start. Session 20's calls 3 and 4 ran earlier
versions of this script (bench/results/2026-12-03-h200-session20/README.md says which).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import xpu  # noqa: E402
import strategies.memferry.profiler as profiler  # noqa: E402
from strategies.memferry.hf_models import model_loss  # noqa: E402
from strategies.models.families import build_model  # noqa: E402


def _both(backend, fn, before, repeats):  # noqa: ANN001, ANN202
    """Median (alone, issued ahead) seconds of ``fn`` over ``repeats``; ``before`` holds the
    host time of the round before (updated)."""
    alone, ahead = [], []
    for _ in range(repeats):
        a, before[0] = profiler._timed(backend, 0, fn)
        b, before[0] = profiler._timed(backend, 0, fn, before[0])
        alone.append(a)
        ahead.append(b)
    return statistics.median(alone), statistics.median(ahead)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    backend = xpu.get_backend()
    dev = backend.device(0)
    model = build_model("gpt", dtype=torch.bfloat16, layers=1, hidden=args.hidden, heads=args.heads, vocab=32000,
                        seq=args.seq).to(dev)
    model.loss_chunks = 8
    blk = model.blocks[0]
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    tokens = torch.randint(0, 32000, (args.batch, args.seq + 1), device=dev)
    model.blocks[0] = profiler._PassThrough()  # the rest: embeddings, head and loss around a pass-through
    held: dict[str, torch.Tensor] = {}

    def block_fwd() -> None:
        held["out"] = blk(x)

    def block_bwd() -> None:
        torch.autograd.backward([held["out"]], [grad])

    def rest_fwd() -> None:
        held["loss"] = model_loss(model, tokens[:, :-1], tokens[:, 1:])

    def rest_bwd() -> None:
        held["loss"].backward()

    print("| round | block forward alone / ahead ms | block backward alone / ahead ms | "
          "rest forward alone / ahead ms | rest backward alone / ahead ms |")
    print("|---:|---:|---:|---:|---:|")
    host = {k: [0.0] for k in ("bf", "bb", "rf", "rb")}
    for r in range(args.rounds):
        cells = []
        for fwd, bwd, kf, kb in ((block_fwd, block_bwd, "bf", "bb"), (rest_fwd, rest_bwd, "rf", "rb")):
            fa, fb = _both(backend, fwd, host[kf], args.repeats)
            ba, bb = [], []
            for _ in range(args.repeats):  # a backward needs a fresh forward each time
                fwd()
                a, host[kb][0] = profiler._timed(backend, 0, bwd)
                fwd()
                b, host[kb][0] = profiler._timed(backend, 0, bwd, host[kb][0])
                ba.append(a)
                bb.append(b)
            cells += [f"{fa * 1e3:.3f} / {fb * 1e3:.3f}",
                      f"{statistics.median(ba) * 1e3:.3f} / {statistics.median(bb) * 1e3:.3f}"]
        print(f"| {r} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
