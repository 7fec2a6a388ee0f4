"""A Llama-style model: RMSNorm, SwiGLU MLP, rotary position embedding, grouped-query attention."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM, Embedding, Linear, RMSNorm

__all__ = ["Llama", "LlamaBlock", "LlamaAttention", "llama_ffn", "rotary_tables", "apply_rotary"]

def rotary_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq, head_dim // 2), in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of x (B, H, T, D) by the tables."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings: ``kv_heads`` K/V heads shared by ``heads`` queries."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.rope_theta = rope_theta
        self.q = Linear(hidden, heads * self.head_dim, bias=False)
        self.k = Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = Linear(heads * self.head_dim, hidden, bias=False)
        # A plain attribute, not a buffer: FSDP2 and ZeRO-3 leave it alone, and it follows the input's device.
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (t, str(device))
        if key not in self._rope:
            self._rope[key] = rotary_tables(t, self.head_dim, self.rope_theta, device)
        return self._rope[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._tables(t, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.heads:
            # repeat_interleave, not sdpa(enable_gqa=...): portable to every backend's attention kernel.
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, rope_theta: float, norm_eps: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden, norm_eps)
        self.attn = LlamaAttention(hidden, heads, kv_heads, rope_theta)
        self.norm2 = RMSNorm(hidden, norm_eps)
        self.gate = Linear(hidden, ffn, bias=False)
        self.up = Linear(hidden, ffn, bias=False)
        self.down = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """SwiGLU width as in Llama: 8/3 of hidden, rounded up to a multiple of ``multiple_of``."""
    return multiple_of * math.ceil(int(8 * hidden / 3) / multiple_of)


class Llama(CausalLM):
    """Llama-style decoder: RMSNorm, SwiGLU, rotary, grouped-query attention, no biases."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int = 1024, kv_heads: int | None = None,
                 ffn: int | None = None, rope_theta: float = 10000.0, norm_eps: float = 1e-5) -> None:
        super().__init__()
        kv_heads = kv_heads or heads
        ffn = ffn or llama_ffn(hidden)
        self.tok_emb = Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn, rope_theta, norm_eps) for _ in range(layers))
        self.norm = RMSNorm(hidden, norm_eps)
        self.head = Linear(hidden, vocab, bias=False)

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self._run_blocks(self.tok_emb(idx)))


