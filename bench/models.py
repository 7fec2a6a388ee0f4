"""Benchmark models: the GPT of DESIGN.md §3, a Llama-style variant, and Hugging Face causal LMs.

Every model is a :class:`CausalLM`: ``model(idx, targets)`` returns the mean next-token loss
computed in fp32 (``model(idx)`` returns logits), and ``model.blocks`` is the list of
transformer blocks (what FSDP2 shards one by one, what recomputation wraps).

Weights are initialised inside each leaf module's own ``reset_parameters`` (normal, std 0.02;
biases zero), never by a pass over the finished model: under ``deepspeed.zero.Init`` a leaf's
parameters are partitioned as soon as its ``__init__`` returns, so a later pass would see
empty tensors and every ZeRO-3 row would start from a different model than the others.

Families and their dimensions (``build_model(family, **dims)``):

* ``gpt``: ``layers, hidden, heads, vocab, seq`` (+ ``mlp_ratio=4``, ``bias=True``,
  ``pos_emb="none"|"learned"``). Pre-LayerNorm blocks with a fused QKV linear, causal
  ``scaled_dot_product_attention``, a 4x GELU MLP and biases, token embedding, final
  LayerNorm and an untied output head (DESIGN.md §3 lists no position embedding; causal
  attention still orders tokens; ``pos_emb="learned"`` adds one).
* ``llama``: ``layers, hidden, heads, kv_heads, vocab, seq`` (+ ``ffn``, ``rope_theta``,
  ``norm_eps``). RMSNorm, SwiGLU MLP, rotary position embedding, grouped-query attention
  (``kv_heads`` divides ``heads``), no biases, untied head.
* ``hf``: ``config`` (a dict with ``model_type`` and ``transformers`` config fields) and
  ``seq``; built with ``AutoModelForCausalLM.from_config`` (nothing is downloaded).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "FAMILIES", "CausalLM", "GPT", "Llama", "build_model", "param_count", "embedding_param_count",
    "flops_per_token", "validate_dims", "default_dims",
]

_INIT_STD = 0.02


class _Linear(nn.Linear):
    """``nn.Linear`` whose own init is N(0, 0.02) with zero bias (see the module docstring for why here)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02) in its own ``__init__``."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (statistics in fp32, output in the input dtype)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class CausalLM(nn.Module):
    """Base of the benchmark models: blocks, optional per-block recomputation, fp32 loss."""

    blocks: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        #: Recompute each block in backward instead of keeping its activations.
        self.recompute = False
        #: Compute the loss over this many slices of the tokens, each slice's logits
        #: recomputed in backward instead of kept: the fp32 logits, their log-softmax and
        #: gradient (3 x 1 GB at batch 8 x 1024, vocab 32000) then exist one slice at a time.
        #: Same loss up to summation order. 1: off (logits computed whole, as the anchors).
        self.loss_chunks = 1

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids ``idx`` (batch, seq)."""
        return self.head(self.features(idx))

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states (batch, seq, hidden), which ``head`` maps to logits."""
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits if ``targets`` is None, else the mean cross-entropy computed in fp32
        (over :attr:`loss_chunks` slices when that is above 1)."""
        if targets is None:
            return self.logits(idx)
        if self.loss_chunks > 1:
            return self._chunked_loss(self.features(idx), targets)
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _slice_loss_sum(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).float(), t, reduction="sum")

    def _chunked_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        recompute = self.training and torch.is_grad_enabled()
        total = h.new_zeros((), dtype=torch.float32)
        for hc, tc in zip(h.chunk(self.loss_chunks), t.chunk(self.loss_chunks)):
            part = checkpoint(self._slice_loss_sum, hc, tc, use_reentrant=False) if recompute else self._slice_loss_sum(hc, tc)
            total = total + part
        return total / (t != -100).sum().clamp(min=1)  # mean over counted targets, as cross_entropy's default


# ---------------------------------------------------------------------------------- GPT
class GPTAttention(nn.Module):
    """Causal self-attention with a fused QKV projection."""

    def __init__(self, hidden: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = _Linear(hidden, 3 * hidden, bias=bias)
        self.proj = _Linear(hidden, hidden, bias=bias)

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
        self.fc = _Linear(hidden, mlp_ratio * hidden, bias=bias)
        self.out = _Linear(mlp_ratio * hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(CausalLM):
    """The GPT of DESIGN.md §3 (24 layers, hidden 2048, heads 16, vocab 32000: 1.34e9 parameters)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int = 1024,
                 mlp_ratio: int = 4, bias: bool = True, pos_emb: str = "none") -> None:
        super().__init__()
        self.tok_emb = _Embedding(vocab, hidden)
        self.pos_emb = _Embedding(seq, hidden) if pos_emb == "learned" else None
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, mlp_ratio, bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, bias=bias)
        self.head = _Linear(hidden, vocab, bias=False)

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.ln_f(self._run_blocks(x))


# ---------------------------------------------------------------------------------- Llama
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
        self.q = _Linear(hidden, heads * self.head_dim, bias=False)
        self.k = _Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = _Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = _Linear(heads * self.head_dim, hidden, bias=False)
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
        self.gate = _Linear(hidden, ffn, bias=False)
        self.up = _Linear(hidden, ffn, bias=False)
        self.down = _Linear(ffn, hidden, bias=False)

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
        self.tok_emb = _Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn, rope_theta, norm_eps) for _ in range(layers))
        self.norm = RMSNorm(hidden, norm_eps)
        self.head = _Linear(hidden, vocab, bias=False)

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self._run_blocks(self.tok_emb(idx)))


# ---------------------------------------------------------------------------------- Hugging Face
class HFCausalLM(CausalLM):
    """A ``transformers`` causal LM built from a config, behind the :class:`CausalLM` interface."""

    def __init__(self, config: dict[str, Any], seq: int = 1024) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency

        cfg = dict(config)
        model_type = cfg.pop("model_type")
        cfg.setdefault("max_position_embeddings", seq)
        self.hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
        layers = getattr(self.hf.config, "num_hidden_layers", None)
        # The decoder layers are the first ModuleList as long as the layer count (llama, gpt2, mistral, qwen...).
        found = [m for m in self.hf.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
        self.blocks = found[0] if found else nn.ModuleList()

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - HF runs its own blocks
        raise NotImplementedError

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`CausalLM.forward`; the loss is never sliced (HF models compute logits whole)."""
        if targets is None:
            return self.logits(idx)
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------- registry of families
_GPT_KEYS = {"layers", "hidden", "heads", "vocab", "seq", "mlp_ratio", "bias", "pos_emb"}
_LLAMA_KEYS = {"layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn", "rope_theta", "norm_eps"}
_HF_KEYS = {"config", "seq"}

#: family -> (builder, accepted dimension names, required dimension names)
FAMILIES: dict[str, tuple[Callable[..., CausalLM], set[str], set[str]]] = {
    "gpt": (GPT, _GPT_KEYS, {"layers", "hidden", "heads", "vocab"}),
    "llama": (Llama, _LLAMA_KEYS, {"layers", "hidden", "heads", "vocab"}),
    "hf": (HFCausalLM, _HF_KEYS, {"config"}),
}


def default_dims(family: str) -> dict[str, Any]:
    """The DESIGN.md §3 dimensions for ``gpt``, a Llama of the same width for ``llama``."""
    if family == "gpt":
        return {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000}
    if family == "llama":
        return {"layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 4, "vocab": 32000}
    return {}


def validate_dims(family: str, dims: dict[str, Any]) -> None:
    """Check a family name and its dimensions; the error names the valid values.

    Raises:
        ValueError: unknown family, unknown or missing dimension, or inconsistent sizes.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families: {', '.join(sorted(FAMILIES))}")
    _, accepted, required = FAMILIES[family]
    unknown = set(dims) - accepted
    if unknown:
        raise ValueError(f"model family {family!r} has no dimension(s) {sorted(unknown)}; valid: {sorted(accepted)}")
    missing = required - set(dims)
    if missing:
        raise ValueError(f"model family {family!r} needs dimension(s) {sorted(missing)}")
    if family == "hf":
        if not isinstance(dims["config"], dict) or "model_type" not in dims["config"]:
            raise ValueError("model family 'hf' needs config: {model_type: ..., <transformers config fields>}")
        return
    for key in ("layers", "hidden", "heads", "vocab", "seq", "kv_heads", "ffn", "mlp_ratio"):
        if key in dims and dims[key] is not None and (not isinstance(dims[key], int) or dims[key] < 1):
            raise ValueError(f"model dimension {key} must be a positive integer, got {dims[key]!r}")
    if dims["hidden"] % dims["heads"]:
        raise ValueError(f"hidden {dims['hidden']} must be a multiple of heads {dims['heads']}")
    if family == "llama":
        kv = dims.get("kv_heads") or dims["heads"]
        if dims["heads"] % kv:
            raise ValueError(f"heads {dims['heads']} must be a multiple of kv_heads {kv}")
        if (dims["hidden"] // dims["heads"]) % 2:
            raise ValueError("rotary embedding needs an even head dimension (hidden / heads)")
    if family == "gpt" and dims.get("pos_emb", "none") not in ("none", "learned"):
        raise ValueError(f"pos_emb must be 'none' or 'learned', got {dims['pos_emb']!r}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(family: str, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                **dims: Any) -> CausalLM:
    """Build a model of ``family`` with ``dims``, its parameters created on ``device`` in ``dtype``.

    Creating parameters directly on the target device and dtype avoids a host copy and an
    fp32 transient; ``device="meta"`` allocates nothing (for counting).

    Raises:
        ValueError: see :func:`validate_dims`.
        ImportError: family ``hf`` without ``transformers`` installed.
    """
    validate_dims(family, dims)
    builder = FAMILIES[family][0]
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx, _default_dtype(dtype):
        return builder(**dims)


def _meta_model(family: str, dims: dict[str, Any]) -> CausalLM:
    return build_model(family, device="meta", **dims)


def param_count(family: str, **dims: Any) -> int:
    """Number of parameters, counted on the meta device (nothing is allocated)."""
    return sum(p.numel() for p in _meta_model(family, dims).parameters())


def embedding_param_count(family: str, **dims: Any) -> int:
    """Parameters of embedding tables (token and position): looked up, not multiplied."""
    model = _meta_model(family, dims)
    return sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False))


def _attention_width(family: str, dims: dict[str, Any]) -> tuple[int, int]:
    """(layers, heads * head_dim) for the attention-score term."""
    if family == "hf":
        cfg = dims["config"]
        return int(cfg.get("num_hidden_layers", cfg.get("n_layer", 0))), int(cfg.get("hidden_size", cfg.get("n_embd", 0)))
    return dims["layers"], dims["hidden"]


def flops_per_token(family: str, **dims: Any) -> float:
    """Model FLOPs per trained token (forward + backward), recomputation not counted.

    ``6 * N + 12 * L * S * d`` with N the parameters minus embedding tables (every other
    weight is used once per token in a matmul: 2 FLOPs forward, 4 backward), L layers, S the
    sequence length (``dims["seq"]``, default 1024) and d = heads * head_dim: the attention scores and their weighted sum,
    2 * 2 * S * d forward per layer, three times that with backward, counted over the full
    S x S square as PaLM (appendix B) and Megatron-LM do. For the DESIGN.md §3 GPT at S=1024
    this is 8.25e9 FLOPs per token.
    """
    n = param_count(family, **dims) - embedding_param_count(family, **dims)
    layers, width = _attention_width(family, dims)
    seq = int(dims.get("seq") or 1024)
    return 6.0 * n + 12.0 * layers * seq * width
