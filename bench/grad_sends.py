"""What the gradient-send diagnoses share: one GPT block's gradients on the device, their host
landing zone, and a stand-in for the host optimizer (``bench/scripts/diag_grad_post.py``,
``diag_hook_thread.py``)."""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import torch

from strategies.memferry.config import AdamW
from strategies.models import build_model

__all__ = ["BlockGradients", "Submitted", "block_gradients"]


class Submitted:
    """Stands in for the host optimizer: ``submit`` queues, as the real one does; ``cfg`` is the
    optimizer's settings ``GradientPost`` reads (the landing wait, flat sends)."""

    def __init__(self, cfg: AdamW | None = None) -> None:
        self.tasks: queue.Queue = queue.Queue()
        self.cfg = cfg or AdamW()

    def submit(self, index, ready, final=True, landed=None, summed=False, zone=0) -> None:  # noqa: D102
        self.tasks.put(("grad", index, (ready, final, landed, summed, zone)))

    def drain(self) -> None:
        """Forget what was submitted."""
        while not self.tasks.empty():
            self.tasks.get_nowait()


@dataclass
class BlockGradients:
    """A block's bf16 gradients on the device (``sources``) and their landing zone: ``targets``,
    back-to-back views of one pinned host buffer ``host`` of ``numel`` elements."""

    sources: list[torch.Tensor]
    targets: list[torch.Tensor]
    host: torch.Tensor
    numel: int


def block_gradients(backend: Any, hidden: int, heads: int) -> BlockGradients:
    """Random gradients shaped as one GPT block's parameters (``hidden``, ``heads``) on device
    0, and their pinned landing zone, laid out as the engine lays a unit's."""
    block = build_model("gpt", dtype=torch.bfloat16, layers=1, hidden=hidden, heads=heads, vocab=256,
                        seq=128).blocks[0]
    shapes = [p.shape for p in block.parameters()]
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    dev = backend.device(0)
    sources = [torch.randn(s, dtype=torch.bfloat16, device=dev) for s in shapes]
    host = backend.alloc_pinned(numel * 2).view(torch.bfloat16)
    targets, off = [], 0
    for s in shapes:
        n = int(torch.Size(s).numel())
        targets.append(host[off:off + n].view(s))
        off += n
    return BlockGradients(sources, targets, host, numel)
