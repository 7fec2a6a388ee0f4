"""Diagnostic: what the pieces of a gradient send cost on each thread that may run them.

A send of one block's gradients took 0.42 ms inside a backward hook (autograd's device thread)
and 0.19 ms on the main thread, alone on an idle host (``diag_grad_post.py``, H200, 2026-12-04);
a profiled step put 88 % of a send in Python, outside every runtime call. This times the send's
pieces one by one in four places, to say which piece is dearer where:
  main      the main thread
  thread    a Python thread (``threading.Thread``)
  cpu-hook  a backward hook of a CPU graph (the engine runs it on the calling thread)
  dev-hook  a backward hook of a device graph (autograd's device thread, where steps send)
Pieces (each repeated ``--inner`` times per sample, microseconds per repetition):
  python        a small pure-Python loop (the interpreter alone)
  clock         ``time.thread_time()`` (a system call)
  empty         ``torch.empty(0)`` (one dispatched op, GIL released and taken back)
  event         ``backend.event()`` and its record on the compute stream
  stream_ctx    entering and leaving ``backend.use_stream(d2h)``
  device_ctx    entering and leaving ``backend.device_scope(0)``
  record_fn     entering and leaving ``torch.profiler.record_function``
  copy_many     one block's gradients home in one ``backend.copy_many`` (inner 1)
  send          ``GradientPost.send`` of the block (inner 1)
  send_flat     the same with ``flat_sends`` (gathered on the device, one copy home; inner 1)

Usage: XPU_BACKEND=cuda python3 bench/scripts/diag_hook_thread.py [--samples 100] [--inner 20]
  (on the device: bash bench/scripts/gpu_diag.sh hook_thread)
Prints a table: median microseconds per repetition, one column per place.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

import xpu
from bench.grad_sends import Submitted, block_gradients
from strategies.memferry.config import AdamW
from strategies.memferry.grad_post import GradientPost


def _pieces(b: xpu.Backend, hidden: int, heads: int) -> dict[str, tuple[Callable[[], None], bool]]:
    """Each piece: (one repetition, whether it repeats ``inner`` times)."""
    grads = block_gradients(b, hidden, heads)
    sources, targets = grads.sources, grads.targets
    d2h = b.stream(0)

    def sending(flat: bool) -> Callable[[], None]:  # GradientPost.send, per tensor or flat
        opt = Submitted(AdamW(flat_sends=flat))
        post = GradientPost(b, 0, d2h, opt)  # type: ignore[arg-type]

        def send() -> None:
            post.send(0, sources, targets, final=False)
            opt.drain()
        return send

    def python() -> None:
        x = 0
        for i in range(50):
            x += i * i

    def event() -> None:
        b.event().record(b.current_stream(0))

    def stream_ctx() -> None:
        with b.use_stream(d2h):
            pass

    def device_ctx() -> None:
        with b.device_scope(0):
            pass

    def record_fn() -> None:
        with torch.profiler.record_function("diag"):
            pass

    def copy_many() -> None:
        with b.device_scope(0), b.use_stream(d2h):
            b.copy_many(targets, sources)

    return {"python": (python, True), "clock": (time.thread_time, True),
            "empty": (lambda: torch.empty(0), True), "event": (event, True),
            "stream_ctx": (stream_ctx, True), "device_ctx": (device_ctx, True),
            "record_fn": (record_fn, True), "copy_many": (copy_many, False), "send": (sending(False), False),
            "send_flat": (sending(True), False)}


def _timed(fn: Callable[[], None], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _in_place(place: str, fn: Callable[[], None], inner: int, leaf_dev: torch.Tensor,
              leaf_cpu: torch.Tensor) -> float:
    """One sample of ``fn`` (``inner`` repetitions) run in ``place``; seconds per repetition."""
    if place == "main":
        return _timed(fn, inner)
    took: list[float] = []
    if place == "thread":
        t = threading.Thread(target=lambda: took.append(_timed(fn, inner)))
        t.start()
        t.join()
        return took[0]
    leaf = leaf_dev if place == "dev-hook" else leaf_cpu
    out = leaf * 2.0
    out.register_hook(lambda g: took.append(_timed(fn, inner)))
    out.sum().backward()
    return took[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--inner", type=int, default=20)
    a = ap.parse_args()
    b = xpu.get_backend()
    pieces = _pieces(b, a.hidden, a.heads)
    leaf_dev = torch.zeros(1, device=b.device(0), requires_grad=True)
    leaf_cpu = torch.zeros(1, requires_grad=True)
    places = ("main", "thread", "cpu-hook", "dev-hook")
    table: dict[str, dict[str, float]] = {}
    for name, (fn, repeats) in pieces.items():
        inner = a.inner if repeats else 1
        for place in places:
            _in_place(place, fn, inner, leaf_dev, leaf_cpu)  # warm
            b.synchronize(0)
            samples = []
            for _ in range(a.samples):
                samples.append(_in_place(place, fn, inner, leaf_dev, leaf_cpu))
                b.synchronize(0)
            table.setdefault(name, {})[place] = statistics.median(samples) * 1e6
    print(f"backend {b.name}; {a.samples} samples; medians in microseconds per repetition")
    print("| piece | " + " | ".join(places) + " | dev-hook / main |")
    print("|---|" + "---:|" * (len(places) + 1))
    for name, row in table.items():
        ratio = row["dev-hook"] / row["main"] if row["main"] > 0 else float("nan")
        print(f"| {name} | " + " | ".join(f"{row[p]:.2f}" for p in places) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
