"""Models the training layer, the strategies and the harness share: a GPT, a Llama-style model, Hugging Face LMs.

Every model is a :class:`CausalLM`: ``model(idx, targets)`` returns the mean next-token loss
computed in fp32 (``model(idx)`` returns logits), and ``model.blocks`` is the list of
transformer blocks (what FSDP2 shards one by one, what recomputation wraps).

Families and their dimensions (``build_model(family, **dims)``):

* ``gpt``: ``layers, hidden, heads, vocab, seq`` (+ ``mlp_ratio=4``, ``bias=True``,
  ``pos_emb="none"|"learned"``). Pre-LayerNorm blocks with a fused QKV linear, causal
  ``scaled_dot_product_attention``, a 4x GELU MLP and biases, token embedding, final
  LayerNorm and an untied output head (docs/design.md §3 lists no position embedding; causal
  attention still orders tokens; ``pos_emb="learned"`` adds one).
* ``llama``: ``layers, hidden, heads, kv_heads, vocab, seq`` (+ ``ffn``, ``rope_theta``,
  ``norm_eps``). RMSNorm, SwiGLU MLP, rotary position embedding, grouped-query attention
  (``kv_heads`` divides ``heads``), no biases, untied head.
* ``hf``: either ``config`` (a dict with ``model_type`` and ``transformers`` config fields, each
  checked against the config class; random init with ``AutoModelForCausalLM.from_config``) or
  ``path`` (a local ``save_pretrained`` folder: config.json + safetensors weights, loaded with
  ``from_pretrained(local_files_only=True)``; a hub name is refused, nothing is downloaded), plus
  ``seq`` and optional ``lora: {r, alpha, dropout, target_modules}`` (peft LoRA: base frozen).
  Checks in :mod:`.hf_config`; HF format out in :mod:`strategies.training.export`.

A plain ``transformers`` causal LM (what Hugging Face's Trainer drives) keeps its own forward;
:func:`slice_hf_loss` makes its training loss run over token slices, without whole logits.
"""
from .base import CausalLM, RMSNorm
from .families import (FAMILIES, build_model, default_dims, embedding_param_count, flops_per_token, param_count,
                       validate_dims)
from .gpt import GPT
from .hf import HFCausalLM
from .hf_sliced_loss import slice_hf_loss
from .llama import Llama, apply_rotary, llama_ffn, rotary_tables

__all__ = [
    "FAMILIES", "CausalLM", "RMSNorm", "GPT", "Llama", "HFCausalLM", "llama_ffn", "rotary_tables", "apply_rotary", "build_model", "param_count",
    "embedding_param_count", "flops_per_token", "validate_dims", "default_dims", "slice_hf_loss",
]
