"""The model families by name: their dimensions, checks, builder, and parameter and FLOP counts."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .base import CausalLM
from .gpt import GPT
from .hf import HFCausalLM
from .hf_config import HF_KEYS, check_hf_dims, hf_config_dict
from .llama import Llama

__all__ = ["FAMILIES", "build_model", "param_count", "embedding_param_count", "flops_per_token", "validate_dims",
           "default_dims"]

_GPT_KEYS = {"layers", "hidden", "heads", "vocab", "seq", "mlp_ratio", "bias", "pos_emb"}
_LLAMA_KEYS = {"layers", "hidden", "heads", "kv_heads", "vocab", "seq", "ffn", "rope_theta", "norm_eps"}
_HF_KEYS = HF_KEYS

#: family -> (builder, accepted dimension names, required dimension names)
FAMILIES: dict[str, tuple[Callable[..., CausalLM], set[str], set[str]]] = {
    "gpt": (GPT, _GPT_KEYS, {"layers", "hidden", "heads", "vocab"}),
    "llama": (Llama, _LLAMA_KEYS, {"layers", "hidden", "heads", "vocab"}),
    "hf": (HFCausalLM, _HF_KEYS, set()),  # config or path: check_hf_dims
}


def default_dims(family: str) -> dict[str, Any]:
    """The docs/design.md §3 dimensions for ``gpt``, a Llama of the same width for ``llama``."""
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
        check_hf_dims(dims)
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
        cfg = hf_config_dict(dims)
        return int(cfg.get("num_hidden_layers", cfg.get("n_layer", 0))), int(cfg.get("hidden_size", cfg.get("n_embd", 0)))
    return dims["layers"], dims["hidden"]


def flops_per_token(family: str, **dims: Any) -> float:
    """Model FLOPs per trained token (forward + backward), recomputation not counted.

    ``6 * N + 12 * L * S * d`` with N the parameters minus embedding tables (every other
    weight is used once per token in a matmul: 2 FLOPs forward, 4 backward), L layers, S the
    sequence length (``dims["seq"]``, default 1024) and d = heads * head_dim: the attention scores and their weighted sum,
    2 * 2 * S * d forward per layer, three times that with backward, counted over the full
    S x S square as PaLM (appendix B) and Megatron-LM do. For the docs/design.md §3 GPT at S=1024
    this is 8.25e9 FLOPs per token.
    """
    n = param_count(family, **dims) - embedding_param_count(family, **dims)
    layers, width = _attention_width(family, dims)
    seq = int(dims.get("seq") or 1024)
    return 6.0 * n + 12.0 * layers * seq * width
