"""Write a randomly initialised Hugging Face causal LM folder (``save_pretrained``), from a config alone.

Nothing is downloaded: the config is built here, the weights drawn by ``from_config`` (seeded),
cast to ``--dtype`` and saved as safetensors. A bench scenario then loads it with
``model: {family: hf, path: DIR}`` (``from_pretrained(local_files_only=True)``)::

    python bench/scripts/make_hf_model.py --arch qwen2 --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \\
        --ffn 8960 --vocab 151936 --tied --out /tmp/xpu-qwen2-1.5b      # Qwen2-1.5B's shape, ~1.54 B params

An existing folder with the same config is kept as it is (``--force`` rewrites it), so a device
call can run the command before every ``xpu bench`` at no cost after the first.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["hf_config_fields", "make_hf_model", "main"]

#: --arch -> transformers model_type (the Llama-style decoders whose config takes these fields)
ARCHS = ("qwen2", "llama", "mistral")


def hf_config_fields(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                     tied: bool, max_positions: int) -> dict[str, Any]:
    """The transformers config fields of the model (``model_type`` included).

    Raises:
        ValueError: an unknown ``arch`` or sizes that do not divide (heads into hidden, kv_heads into heads).
    """
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not supported; valid: {', '.join(ARCHS)}")
    if min(hidden, layers, heads, kv_heads, ffn, vocab, max_positions) < 1:
        raise ValueError("every size must be a positive integer")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(f"hidden {hidden} must split into {heads} heads of even width, and heads into "
                         f"kv_heads {kv_heads}")
    return {"model_type": arch, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": ffn, "vocab_size": vocab,
            "tie_word_embeddings": tied, "max_position_embeddings": max_positions}


def make_hf_model(fields: dict[str, Any], out: str | Path, dtype: str = "bf16", seed: int = 0,
                  force: bool = False) -> Path:
    """Build the model of ``fields`` (random init, seeded) and ``save_pretrained`` it into ``out``.

    Returns ``out``; an ``out`` already holding this config and safetensors is left as it is
    unless ``force``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out).expanduser()
    marker = out / "xpu_make_hf_model.json"
    wanted = {**fields, "dtype": dtype, "seed": seed}
    if not force and marker.is_file() and any(out.glob("*.safetensors")) and json.loads(marker.read_text()) == wanted:
        return out
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    cfg = dict(fields)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # fp32 init, then one cast: the same draws at any dtype
    model = model.to(torch_dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(wanted))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); exit code 2 on bad arguments."""
    p = argparse.ArgumentParser(prog="make_hf_model.py", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen2", help=f"model type: {', '.join(ARCHS)}")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--ffn", type=int, required=True, help="intermediate (MLP) size")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--tied", action="store_true", help="tie the output embedding to the input embedding")
    p.add_argument("--max-positions", type=int, default=32768)
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="weights' dtype on disk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rewrite an existing folder")
    p.add_argument("--out", required=True, help="folder to write")
    args = p.parse_args(argv)
    try:
        fields = hf_config_fields(args.arch, args.hidden, args.layers, args.heads, args.kv_heads or args.heads,
                                  args.ffn, args.vocab, args.tied, args.max_positions)
    except ValueError as exc:
        print(f"make_hf_model.py: {exc}", file=sys.stderr)
        return 2
    out = make_hf_model(fields, args.out, args.dtype, args.seed, args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
