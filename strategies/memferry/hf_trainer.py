"""Hugging Face ``transformers.Trainer`` driving a MemFerry engine.

    engine = MemFerry(hf_model, optim=AdamW(lr=..., weight_decay=..., max_grad_norm=1.0),
                      accumulation_steps=4)
    args = TrainingArguments(..., gradient_accumulation_steps=4, max_grad_norm=0, save_strategy="no")
    trainer = memferry_trainer(engine, args, train_dataset=data)
    trainer.train()
    weights = engine.state_dict()["model"]

Trainer runs its own loop: ``model(**batch).loss``, ``accelerator.backward(loss)`` (a plain
``loss.backward()``, which the engine's forward made drive MemFerry: ``backward_gate.py``),
``optimizer.step()`` (the engine's step, through :meth:`MemFerry.as_torch_optimizer`) and its
learning-rate scheduler, which sets the engine's rate. MemFerry keeps the gradients and clips them
itself, so Trainer's ``max_grad_norm`` must be 0 and its accumulation must equal the engine's;
:func:`check_trainer_args` refuses anything else. Checkpoints through Trainer are not supported yet
(``save_strategy="no"``): take ``engine.state_dict()``, or export with ``xpu export``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["MemFerryModel", "check_trainer_args", "memferry_trainer"]


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """What Trainer would decide for ``model`` itself: may it be given ``num_items_in_batch``?"""
    base = getattr(model, "get_base_model", None)  # Trainer inspects a PEFT model's base model
    inner = base() if callable(base) else model
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    params = inspect.signature(inner.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class MemFerryModel(nn.Module):
    """The ``nn.Module`` Trainer is given for a MemFerry ``engine`` over a Hugging Face model.

    It has no parameters of its own: the engine's model is held outside the module tree, so
    Trainer's ``model.to(device)`` and ``zero_grad()`` leave the host-homed weights alone. It shows
    Trainer what it inspects on the real model (``config``, ``main_input_name``, ``loss_type``,
    whether it takes ``num_items_in_batch``), so Trainer scales the loss exactly as for that model.
    """

    def __init__(self, engine: Any) -> None:
        super().__init__()
        inner = engine.model
        object.__setattr__(self, "engine", engine)  # not a submodule (see the class docstring)
        self.config = getattr(inner, "config", None)
        self.main_input_name = getattr(inner, "main_input_name", "input_ids")
        self.accepts_loss_kwargs = _accepts_loss_kwargs(inner)
        base = getattr(inner, "get_base_model", None)
        loss_type = getattr(base() if callable(base) else inner, "loss_type", None)
        if loss_type is not None:
            self.loss_type = loss_type  # Trainer counts a causal LM's tokens over the shifted labels
        self.training = inner.training

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The engine's forward on ``model(input_ids=..., labels=..., ...)``: the model's own output
        (``.loss`` when ``labels`` are given); its ``.loss.backward()`` is MemFerry's backward."""
        named = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        return self.engine(**{k: v for k, v in named.items() if v is not None}, **kwargs)

    def train(self, mode: bool = True) -> "MemFerryModel":
        """Train or eval mode, for the engine's model too (dropout)."""
        super().train(mode)
        self.engine.model.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The engine's weights (full host tensors, waits for pending updates)."""
        return self.engine.state_dict()["model"]

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """Refused: save with ``engine.state_dict()`` or ``xpu export`` (strategies/training/export.py)."""
        raise NotImplementedError("a MemFerry model is not saved through Trainer / save_pretrained yet: take "
                                  "engine.state_dict()['model'] (or export a run with `xpu export`), and give "
                                  "TrainingArguments(save_strategy='no')")


def check_trainer_args(args: Any, engine: Any) -> None:
    """Refuse ``TrainingArguments`` under which Trainer would not train ``engine`` as asked (one-line ValueError)."""
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        raise ValueError(f"TrainingArguments.max_grad_norm={args.max_grad_norm} would clip nothing (MemFerry holds the "
                         f"gradients): give max_grad_norm=0 and clip with MemFerry's AdamW(max_grad_norm=...)")
    if args.gradient_accumulation_steps != engine.micro.steps:
        raise ValueError(f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps} differs from "
                         f"the engine's accumulation_steps={engine.micro.steps}: give both the same number")
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy != "no":
        raise ValueError(f"TrainingArguments.save_strategy={strategy!r}: Trainer checkpoints of a MemFerry model are "
                         f"not supported yet; give save_strategy='no' and save engine.state_dict()")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError(f"Trainer would spread this MemFerry model over {max(args.world_size, args.n_gpu)} devices; "
                         f"run one process on one visible device (MemFerry's data parallelism is its own)")


def memferry_trainer(engine: Any, args: Any, **trainer_kwargs: Any) -> Any:
    """A ``transformers.Trainer`` training ``engine`` (see the module docstring), after
    :func:`check_trainer_args`. ``trainer_kwargs`` go to Trainer (``train_dataset``,
    ``data_collator``...); not ``model`` or ``optimizers``: the engine is both. Trainer's own
    scheduler (``args.lr_scheduler_type``, ``warmup_steps``...) drives the engine's rate."""
    import transformers

    check_trainer_args(args, engine)
    taken = sorted({"model", "optimizers", "optimizer_cls_and_kwargs"} & set(trainer_kwargs))
    if taken:
        raise ValueError(f"memferry_trainer makes {taken} from the engine: leave them out")
    trainer = transformers.Trainer(model=MemFerryModel(engine), args=args,
                                   optimizers=(engine.as_torch_optimizer(), None), **trainer_kwargs)
    # accelerate's optimizer wrapper would otherwise round-trip the optimizer's state_dict (every
    # fp32 master and moment) through the accelerator: a full copy of them in device memory.
    trainer.accelerator.device_placement = False
    return trainer
