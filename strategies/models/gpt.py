"""The GPT of docs/design.md §3: pre-LayerNorm blocks, fused QKV, causal SDPA, 4x GELU MLP, untied head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM, Embedding, Linear

__all__ = ["GPT", "GPTBlock", "GPTAttention"]

class GPTAttention(nn.Module):
    """Causal self-attention with a fused QKV projection."""

    def __init__(self, hidden: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = Linear(hidden, 3 * hidden, bias=bias)
        self.proj = Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int, bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, bias=bias)
        self.attn = GPTAttention(hidden, heads, bias)
        self.ln2 = nn.LayerNorm(hidden, bias=bias)
        self.fc = Linear(hidden, mlp_ratio * hidden, bias=bias)
        self.out = Linear(mlp_ratio * hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(CausalLM):
    """The GPT of docs/design.md §3 (24 layers, hidden 2048, heads 16, vocab 32000: 1.34e9 parameters)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int = 1024,
                 mlp_ratio: int = 4, bias: bool = True, pos_emb: str = "none") -> None:
        super().__init__()
        self.tok_emb = Embedding(vocab, hidden)
        self.pos_emb = Embedding(seq, hidden) if pos_emb == "learned" else None
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, mlp_ratio, bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, bias=bias)
        self.head = Linear(hidden, vocab, bias=False)

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.ln_f(self._run_blocks(x))


