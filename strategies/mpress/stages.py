"""Splitting a causal LM into pipeline stages: embeddings on the first, head and loss on the last.

Works on :class:`strategies.models.GPT` and :class:`strategies.models.Llama` (anything with ``tok_emb``,
optional ``pos_emb``, ``blocks``, a final norm ``ln_f`` or ``norm``, and ``head``). A stage
keeps the original module objects, so its parameter names match the unpipelined model's
(``blocks.3.fc.weight``...) and gradients can be compared name by name.
"""
from __future__ import annotations

import torch
from torch import nn

from strategies.models.base import token_mean_loss

from .executor import StageExecutor

__all__ = ["partition_blocks", "StageModule", "split_model", "lm_loss"]


def partition_blocks(num_blocks: int, num_stages: int, counts: list[int] | None = None) -> list[range]:
    """Global block indices of each stage: ``counts`` if given, else as even as possible.

    Raises:
        ValueError: fewer blocks than stages, or counts that do not add up.
    """
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if counts is None:
        if num_blocks < num_stages:
            raise ValueError(f"{num_blocks} blocks cannot fill {num_stages} stages (each needs at least one)")
        base, extra = divmod(num_blocks, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(counts) != num_stages or sum(counts) != num_blocks or any(c < 1 for c in counts):
        raise ValueError(f"block counts {counts} must be {num_stages} positive numbers adding up to {num_blocks}")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 over the counted targets, as :meth:`strategies.models.CausalLM.forward`."""
    return token_mean_loss(logits, targets)


class StageModule(nn.Module):
    """One pipeline stage of a causal LM.

    Args:
        model: the full model (its modules are shared, not copied).
        stage: this stage's index.
        num_stages: the pipeline depth.
        blocks: global indices of the blocks this stage runs.
    """

    def __init__(self, model: nn.Module, stage: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        for attr in ("tok_emb", "blocks", "head"):
            if not hasattr(model, attr):
                raise ValueError(f"cannot split {type(model).__name__}: it has no '{attr}' (GPT and Llama are supported)")
        self.stage, self.num_stages = stage, num_stages
        self.block_ids = list(blocks)
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.tok_emb = model.tok_emb
            self.pos_emb = getattr(model, "pos_emb", None)
        # A ModuleDict keyed by the global index keeps names as in the full model (blocks.<i>.*).
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.block_ids})
        if self.is_last:
            norm = getattr(model, "ln_f", None) or getattr(model, "norm", None)
            if norm is None:
                raise ValueError(f"cannot split {type(model).__name__}: no final norm 'ln_f' or 'norm'")
            self.final_norm_name = "ln_f" if hasattr(model, "ln_f") else "norm"
            self.add_module(self.final_norm_name, norm)
            self.head = model.head
        #: Set by the runtime; without one the blocks just run (keep everything).
        self.executor: StageExecutor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last stage) out."""
        if self.is_first:
            idx = x
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        ex = self.executor
        if ex is not None:
            ex.begin_forward(x)
        for i in self.block_ids:
            block = self.blocks[str(i)]
            x = ex.run_block(i, block, x) if ex is not None else block(x)
        if self.is_last:
            x = self.head(getattr(self, self.final_norm_name)(x))
        return x


def split_model(model: nn.Module, num_stages: int, counts: list[int] | None = None) -> list[StageModule]:
    """All stages of ``model`` (each process keeps only its own; the rest is freed with the model)."""
    parts = partition_blocks(len(model.blocks), num_stages, counts)
    return [StageModule(model, s, num_stages, parts[s]) for s in range(num_stages)]
