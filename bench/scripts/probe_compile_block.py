"""Can MemFerry run its blocks through ``torch.compile``? What the executor and the profiler rely on,
checked on one block of the project's GPT (any backend; the cpu backend compiles with Inductor's
C++ code, a device backend with Triton).

MemFerry points a block's parameters at other storage between uses (``UnitShadow.bind`` sets
``p.data``: a prefetch slot, the device home, the host copy), wraps a block's forward in
``checkpoint`` (or selective recomputation's) to recompute it, counts what autograd saves through saved-tensor hooks (the
profiler), hooks each parameter's accumulated gradient (the gradient offload) and deep-copies
blocks to profile them. Each line printed says whether that holds for a block whose ``forward``
was replaced by ``torch.compile(block.forward)``, and how many graphs were compiled in all:

    python3 bench/scripts/probe_compile_block.py [--hidden 64] [--seq 32]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    import xpu
    from strategies.models import build_model

    backend = xpu.get_backend()
    dev = backend.device(0)
    torch.manual_seed(0)
    model = build_model("gpt", dtype=torch.float32, layers=2, hidden=args.hidden, heads=4, vocab=128,
                        seq=args.seq).to(dev)
    block, other = model.blocks[0], model.blocks[1]
    eager = copy.deepcopy(block)
    x = torch.randn(2, args.seq, args.hidden, device=dev, requires_grad=True)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    block.forward = torch.compile(block.forward, dynamic=False)
    t0 = time.perf_counter()
    block(x).sum().backward()
    print(f"first forward + backward (compiling): {time.perf_counter() - t0:.1f} s, graphs {graphs()}")
    print("output equals eager's:", torch.allclose(block(x), eager(x), atol=1e-5, rtol=1e-5))

    for p, q in zip(block.parameters(), eager.parameters()):  # as bind() does: new storage, same Parameter
        p.data = p.data.clone() * 1.01
        q.data = q.data.clone() * 1.01
    print("after p.data moved: output equals eager's:", torch.allclose(block(x), eager(x), atol=1e-5, rtol=1e-5),
          "graphs", graphs())

    out = checkpoint(block.forward, x, use_reentrant=False)
    out.sum().backward()
    print("under checkpoint (recomputed in backward): graphs", graphs())

    from strategies.selective_recompute import selective_checkpoint

    x.grad = None
    selective_checkpoint(block.forward, x).sum().backward()
    got, x.grad = x.grad, None
    eager(x).sum().backward()
    print("under selective recomputation: input gradient equals eager's:",
          torch.allclose(got, x.grad, atol=1e-5, rtol=1e-5), "graphs", graphs())

    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel() * t.element_size()), t)[1],
                                                  lambda t: t):
        block(x)
    eager_saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (eager_saved.append(t.numel() * t.element_size()), t)[1],
                                                  lambda t: t):
        eager(x)
    print(f"saved-tensor hooks see the compiled graph's saves: {len(saved)} tensors, {sum(saved)} B "
          f"(eager: {len(eager_saved)}, {sum(eager_saved)} B)")

    fired: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: fired.append(1)) for p in block.parameters()]
    block(x).sum().backward()
    print(f"post-accumulate-grad hooks fired: {len(fired)} of {len(handles)}")

    other.forward = torch.compile(other.forward, dynamic=False)
    other(x).sum().backward()
    print("a second block of the same class compiled: graphs", graphs())

    twin = copy.deepcopy(block)
    print("a deep copy's forward runs the copy's parameters:", getattr(twin.forward, "__self__", None) is twin,
          "(False: it still runs the original's: compile a copy's forward again)")


if __name__ == "__main__":
    main()
