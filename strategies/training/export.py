"""Hugging Face format out: a trained ``hf`` model's weights as a ``save_pretrained`` folder (:func:`export_hf`).

The folder holds ``config.json`` and ``model.safetensors`` (``AutoModelForCausalLM.from_pretrained``
reads it), plus the tokenizer files of the model's ``path`` folder or of ``data.tokenizer``. A LoRA
model is written merged into its base weights (peft ``merge_and_unload``), or as the adapter alone
(``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained``).

Weights are written in the dtype the base model was saved in (``dtype: auto``): a bfloat16
checkpoint fine-tuned with fp32 master weights comes back as bfloat16, the size the user brought
and the dtype ``from_pretrained`` loads it in; ``float32`` keeps the master weights' precision.
A LoRA adapter is merged in the training precision first, then cast.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig, TrainConfigError

__all__ = ["export_hf", "recorded_dtype", "EXPORT_DTYPES", "TOKENIZER_FILES"]

#: ``dtype`` names :func:`export_hf` takes; ``auto`` is the dtype the base model's folder records.
EXPORT_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                                                "float16": torch.float16}

#: Tokenizer files copied next to the weights when the source folder has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def _sections(config: TrainConfig | dict[str, Any]) -> tuple[dict[str, Any], int, str | None]:
    """(model section, seq, data.tokenizer) of a TrainConfig or its ``to_dict()`` form (what checkpoints store)."""
    if isinstance(config, TrainConfig):
        return dict(config.model), config.seq, getattr(config.data, "tokenizer", None)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise TrainConfigError("export: the config has no model section")
    return dict(config["model"]), int(config.get("seq") or 1024), (config.get("data") or {}).get("tokenizer")


def _float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    return next((t.dtype for t in state.values() if torch.is_tensor(t) and t.is_floating_point()), torch.float32)


def recorded_dtype(folder: str | Path | None) -> str | None:
    """The dtype name a ``save_pretrained`` folder's config.json records (``dtype``, or the older
    ``torch_dtype``); None where there is no folder, no config or no record."""
    if folder is None:
        return None
    try:
        record = json.loads((Path(str(folder)).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = (record.get("dtype") or record.get("torch_dtype")) if isinstance(record, dict) else None
    return name if isinstance(name, str) else None


def _target_dtype(dtype: str, model_section: dict[str, Any], whole_model: bool) -> torch.dtype | None:
    """The dtype to write (None: as trained). ``auto`` follows the base model's folder for whole-model
    exports; an adapter alone stays in its training precision, as peft keeps adapters."""
    if dtype not in EXPORT_DTYPES:
        raise TrainConfigError(f"export: unknown dtype {dtype!r}; valid: {', '.join(EXPORT_DTYPES)}")
    if dtype != "auto":
        return EXPORT_DTYPES[dtype]
    return EXPORT_DTYPES.get(recorded_dtype(model_section.get("path")) or "auto") if whole_model else None


def _copy_tokenizer(source: str | None, out: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a folder, or a tokenizer file and its folder's siblings) into ``out``."""
    if source is None:
        return []
    src = Path(str(source)).expanduser()
    copied = []
    if src.is_file():
        shutil.copyfile(src, out / ("tokenizer.json" if src.suffix == ".json" else src.name))
        copied.append(src.name)
        src = src.parent
    if src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and not (out / name).exists():
                shutil.copyfile(src / name, out / name)
                copied.append(name)
    return copied


def export_hf(model_state: dict[str, torch.Tensor], config: TrainConfig | dict[str, Any], out_dir: str | Path,
              merge_lora: bool = True, dtype: str = "auto") -> Path:
    """Write ``model_state`` (an :class:`~strategies.models.HFCausalLM`'s ``state_dict``) as a Hugging Face folder.

    Args:
        model_state: the trained weights by HFCausalLM parameter name (``hf.model.layers.0...``);
            a tied output embedding may be missing (it is tied to the input embedding again).
        config: the run's config (a :class:`TrainConfig` or the dict a checkpoint stores).
        out_dir: the folder to write (created; existing files of the same name are replaced).
        merge_lora: with LoRA, write the adapters merged into the base weights; False: the adapter only.
        dtype: one of :data:`EXPORT_DTYPES`: ``auto`` writes the dtype of the base model's ``path``
            folder (the trained dtype where the model was built from a ``config``, and for an
            adapter alone); ``float32``, ``bfloat16``, ``float16`` cast to that dtype.

    Returns:
        ``out_dir``.

    Raises:
        TrainConfigError: not an ``hf`` model, an unknown ``dtype``, or a state whose names or shapes
            do not match the model.
    """
    from strategies.memferry.hf_models import save_hf_folder, tied_names
    from strategies.models import build_model, validate_dims
    from strategies.training.checks import model_dims

    model_section, seq, tokenizer = _sections(config)
    if model_section.get("family") != "hf":
        raise TrainConfigError(f"export --hf needs a model of family hf (a transformers model); this one is "
                               f"{model_section.get('family')!r}")
    lora = model_section.get("lora") is not None
    target = _target_dtype(dtype, model_section, whole_model=merge_lora or not lora)
    dims = model_dims(model_section, seq)
    try:
        validate_dims("hf", dims)
    except ValueError as exc:
        raise TrainConfigError(f"export: model: {exc}") from None
    with torch.random.fork_rng(devices=[]):  # the build's random init is overwritten; leave the caller's RNG alone
        model = build_model("hf", dtype=_float_dtype(model_state), **dims)
    tied = tied_names(model)
    try:
        missing, unexpected = model.load_state_dict(model_state, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise TrainConfigError(f"export: the weights do not fit the config's model: {' '.join(str(exc).split())[:300]}") from None
    missing = [k for k in missing if k not in tied]  # a tied lm_head shares the embedding just loaded
    if missing or unexpected:
        raise TrainConfigError(f"export: the weights do not match the config's model: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]} ({len(missing)} + {len(unexpected)} names)")
    hf = model.hf
    if lora and merge_lora:
        hf = hf.merge_and_unload()  # in the trained precision, before any cast
    if target is not None:
        hf = hf.to(target)
    out = save_hf_folder(hf, out_dir)
    _copy_tokenizer(tokenizer if tokenizer is not None else model_section.get("path"), out)
    return out
