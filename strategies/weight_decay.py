"""Which parameters get no weight decay, by the rule Hugging Face's Trainer uses.

``Trainer.get_decay_parameter_names`` decays every parameter except those inside an
``nn.LayerNorm`` and those whose qualified name (lower-cased) matches ``bias``, ``layernorm``,
``rmsnorm``, a ``norm`` path component or ``_norm``. Here parameters of any
module whose class name ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, ...) count as
normalisation layers too, so a custom RMSNorm named ``ln`` is caught by class, not only by name.
"""
from __future__ import annotations

import re

from torch import nn

__all__ = ["no_decay_names", "param_groups", "NO_DECAY_PATTERNS"]

#: transformers' ``forbidden_name_patterns`` (trainer.py, get_decay_parameter_names)
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_PATTERNS = tuple(re.compile(p) for p in NO_DECAY_PATTERNS)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm")


def no_decay_names(model: nn.Module) -> set[str]:
    """Qualified names (as ``model.named_parameters()`` gives them) of parameters that get no
    weight decay: biases and normalisation layers' parameters (see the module docstring)."""
    out = set()
    for prefix, module in model.named_modules():
        if _is_norm(module):
            out.update(f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters())
    for name, _ in model.named_parameters(remove_duplicate=False):
        if any(p.search(name.lower()) for p in _PATTERNS):
            out.add(name)
    return out


def param_groups(model: nn.Module, weight_decay: float, no_decay: set[str] | None = None) -> list[dict]:
    """``torch.optim`` parameter groups of ``model``'s trainable parameters: ``[decay, no decay]``
    (``no_decay`` names, default :func:`no_decay_names`), as Hugging Face's Trainer builds them."""
    skip = no_decay_names(model) if no_decay is None else no_decay
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n not in skip], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n in skip], "weight_decay": 0.0}]
