"""The ``hf`` family's model section: checks of ``path`` / ``config`` / ``lora`` and reading a folder's config.json.

Nothing here touches the network: ``path`` must be a local folder written by ``save_pretrained``
(it holds ``config.json``); a hub name such as ``gpt2`` is refused, never downloaded.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

__all__ = ["HF_KEYS", "LORA_KEYS", "LORA_DEFAULTS", "check_hf_dims", "hf_config_dict", "unknown_config_keys"]

#: Dimension names the ``hf`` family takes (exactly one of ``config`` and ``path``).
HF_KEYS = {"config", "path", "seq", "lora"}
#: ``lora:`` keys and their defaults (``target_modules`` None: peft's default for the model type).
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
LORA_KEYS = set(LORA_DEFAULTS)


def _config_json(path: Any) -> Path:
    """``path/config.json``, or ValueError saying a local folder is needed."""
    p = Path(str(path)).expanduser() if isinstance(path, (str, Path)) else None
    if p is None or not (p / "config.json").is_file():
        raise ValueError(f"path {path!r} must be a local folder with config.json (a save_pretrained folder); "
                         f"models are never downloaded")
    return p / "config.json"


def hf_config_dict(dims: dict[str, Any]) -> dict[str, Any]:
    """The transformers config fields of an ``hf`` model section: ``config`` as given, or ``path``'s config.json."""
    if dims.get("path") is not None:
        return json.loads(_config_json(dims["path"]).read_text())
    return dict(dims.get("config") or {})


def unknown_config_keys(model_type: str, keys: set[str]) -> list[str]:
    """The ``keys`` that ``model_type``'s config class does not know (its fields, ``attribute_map``, public attributes).

    transformers stores unknown keyword arguments as plain attributes without a word, so a
    typo (``hiden_size``) would silently build the default width; this finds them first.
    """
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if dataclasses.is_dataclass(cls):  # transformers 5: configs are (strict) dataclasses
        known = {f.name for f in dataclasses.fields(cls)}
    else:  # older transformers: the __init__ signature up the class chain
        known = {n for c in cls.__mro__ if "__init__" in vars(c) for n in inspect.signature(c.__init__).parameters}
    known |= set(getattr(cls, "attribute_map", {}) or {})
    known |= {k for k in vars(cls()) if not k.startswith("_")}
    known |= {k for k, v in inspect.getmembers(cls) if isinstance(v, property) and v.fset is not None}
    return sorted(k for k in keys if k not in known)


def _check_lora(lora: Any) -> None:
    if not isinstance(lora, dict):
        raise ValueError(f"lora must be a mapping with keys {sorted(LORA_KEYS)}, got {lora!r}")
    bad = set(lora) - LORA_KEYS
    if bad:
        raise ValueError(f"lora has no key(s) {sorted(bad)}; valid: {', '.join(sorted(LORA_KEYS))}")
    lo = {**LORA_DEFAULTS, **lora}
    if not isinstance(lo["r"], int) or isinstance(lo["r"], bool) or lo["r"] < 1:
        raise ValueError(f"lora.r must be a positive integer, got {lo['r']!r}")
    if not isinstance(lo["alpha"], (int, float)) or isinstance(lo["alpha"], bool) or lo["alpha"] <= 0:
        raise ValueError(f"lora.alpha must be a positive number, got {lo['alpha']!r}")
    if not isinstance(lo["dropout"], (int, float)) or isinstance(lo["dropout"], bool) or not 0 <= lo["dropout"] < 1:
        raise ValueError(f"lora.dropout must lie in [0, 1), got {lo['dropout']!r}")
    tm = lo["target_modules"]
    if tm is not None and not isinstance(tm, str) and not (isinstance(tm, list) and tm and all(isinstance(t, str) for t in tm)):
        raise ValueError(f"lora.target_modules must be a list of module names (e.g. [q_proj, v_proj]) or 'all-linear', got {tm!r}")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError("lora needs the peft package: pip install peft") from None


def check_hf_dims(dims: dict[str, Any]) -> None:
    """Check an ``hf`` model section (after the family's key check).

    Raises:
        ValueError: both or neither of ``config``/``path``, a non-local ``path``, an unknown
            ``model_type`` or config key, or a bad ``lora`` section.
    """
    has_config, has_path = dims.get("config") is not None, dims.get("path") is not None
    if has_config == has_path:
        raise ValueError("model family 'hf' takes either path: <local save_pretrained folder> (pretrained weights) or "
                         "config: {model_type: ..., <transformers config fields>} (random init), not both or neither")
    if has_path:
        folder = _config_json(dims["path"]).parent
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"path {dims['path']!r} holds no *.safetensors weights; write them with "
                             f"save_pretrained(..., safe_serialization=True)")
        fields = hf_config_dict(dims)
        longest = fields.get("max_position_embeddings", fields.get("n_positions"))
        if isinstance(longest, int) and isinstance(dims.get("seq"), int) and dims["seq"] > longest:
            raise ValueError(f"seq {dims['seq']} exceeds the model's max_position_embeddings {longest} "
                             f"(path {dims['path']!r}); lower seq")
    else:
        cfg = dims["config"]
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise ValueError("model family 'hf' needs config: {model_type: ..., <transformers config fields>}")
        from transformers import CONFIG_MAPPING

        if cfg["model_type"] not in CONFIG_MAPPING:
            raise ValueError(f"config.model_type {cfg['model_type']!r} is not a transformers model type "
                             f"(e.g. llama, gpt2, qwen2, mistral)")
        bad = unknown_config_keys(cfg["model_type"], set(cfg) - {"model_type"})
        if bad:
            raise ValueError(f"config key(s) {bad} are not fields of the {cfg['model_type']} config "
                             f"({CONFIG_MAPPING[cfg['model_type']].__name__})")
    if dims.get("lora") is not None:
        _check_lora(dims["lora"])
