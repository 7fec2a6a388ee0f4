"""Diagnostic: how much the profiler's block timings move between rounds on a fresh process.

    python3 bench/scripts/diag_profile_noise.py [--hidden 2048] [--rounds 8] [--repeats 3]

MemFerry's scheduler times one block's forward and backward (median of ``repeats`` after one
warm-up pass, ``profiler._timed_passes``) and prices every identical block with it. On the H200
the §3 block's forward read 1.38-1.60 ms across runs (2026-11-29 .. 12-03), and one profile's
compute chain was 7 % over the steps' own. Times the same block ``--rounds`` times in a row from
a cold start, each round as the profiler does, then prints each round's figures: does the first
round read slow (clocks, lazy loads) and how wide is the spread once warm? Each round is read
twice: ``alone`` (events around the pass, as the profiler times it) and ``issued ahead`` (the
device first kept busy for twice the pass's host time of the round before and a millisecond, by
fp32 products, so that the host issues the whole pass before the device reaches it; the longer
of the device's and the host's time). The same for the ``rest`` unit (embeddings, head, the loss
in 8 recomputed slices; vocab 32000).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import xpu  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import strategies.memferry.profiler as profiler  # noqa: E402
from strategies.memferry.units import split_units  # noqa: E402
from strategies.models.families import build_model  # noqa: E402
from xpu.timing import event_seconds  # noqa: E402

_host_s: dict[int, float] = {}  # id of the timed function's code -> its host seconds the round before
_product_s: list[float] = []


def _occupy(backend, device, stream, seconds):  # noqa: ANN001, ANN202
    """Queue about ``seconds`` of fp32 products on ``stream`` without waiting for them."""
    a = torch.ones(2048, 2048, device=backend.device(device))
    out = torch.empty_like(a)
    if not _product_s:
        torch.mm(a, a, out=out)
        _product_s.append(max(event_seconds(backend, stream, lambda: torch.mm(a, a, out=out)), 1e-6))
    for _ in range(min(256, math.ceil(seconds / _product_s[0]))):
        torch.mm(a, a, out=out)


def _ahead(backend, device, fn):  # noqa: ANN001, ANN202 (stands in for profiler._timed)
    stream = backend.current_stream(device)
    key = id(getattr(fn, "__code__", fn))
    _occupy(backend, device, stream, 2 * _host_s.get(key, 0.0) + 1e-3)
    host = [0.0]

    def issued() -> None:
        t0 = time.perf_counter()
        fn()
        host[0] = time.perf_counter() - t0

    dev = event_seconds(backend, stream, issued)
    _host_s[key] = host[0]
    return max(dev, host[0])


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
    model = build_model("gpt", dtype=torch.bfloat16, layers=1, hidden=args.hidden, heads=args.heads, vocab=512,
                        seq=args.seq)
    blk = model.blocks[0].to(dev)
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn_like(x)]
    full = build_model("gpt", dtype=torch.bfloat16, layers=1, hidden=args.hidden, heads=args.heads, vocab=32000,
                       seq=args.seq)
    full.loss_chunks = 8
    rest = split_units(full, full.blocks)[-1]
    tokens = torch.randint(0, 32000, (args.batch, args.seq + 1))
    real = profiler._timed
    print("| round | timing | block forward ms | block backward ms | rest forward ms | rest backward ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for name, timed in (("alone", real), ("issued ahead", _ahead)):
            profiler._timed = timed
            f, b = profiler._timed_passes(backend, 0, blk, lambda: blk(x), grads, args.repeats)
            rf, rb, _, _ = profiler._profile_rest(full, full.blocks, rest, tokens[:, :-1], tokens[:, 1:], None,
                                                  backend, 0, args.repeats)
            print(f"| {r} | {name} | {f * 1e3:.3f} | {b * 1e3:.3f} | {rf * 1e3:.3f} | {rb * 1e3:.3f} |", flush=True)
    profiler._timed = real


if __name__ == "__main__":
    main()
