"""Hugging Face ``transformers.Trainer`` driving a MemFerry engine.

    engine = MemFerry(hf_model, optim=AdamW(lr=..., weight_decay=..., max_grad_norm=1.0),
                      accumulation_steps=4)
    args = TrainingArguments(..., gradient_accumulation_steps=4, max_grad_norm=0, save_steps=500)
    trainer = memferry_trainer(engine, args, train_dataset=data, eval_dataset=held_out)
    trainer.train()                                   # or .train(resume_from_checkpoint=True)

Trainer runs its own loop: ``model(**batch).loss``, ``accelerator.backward(loss)`` (a plain
``loss.backward()``, which the engine's forward made drive MemFerry: ``backward_gate.py``),
``optimizer.step()`` (the engine's step, through :meth:`MemFerry.as_torch_optimizer`) and its
learning-rate scheduler, which sets the engine's rate. MemFerry keeps the gradients and clips them
itself, so Trainer's ``max_grad_norm`` must be 0 and its accumulation must equal the engine's.
Trainer builds no optimizer: its ``learning_rate``, ``weight_decay``, Adam betas and epsilon,
where set, must be the engine's AdamW's (else they would be silently unused), its ``optim`` an
AdamW, and ``gradient_checkpointing`` off (the plan recomputes). :func:`check_trainer_args`
refuses anything else, in one line. Trainer logs the engine's pre-clip gradient
norm as ``grad_norm`` (with clipping on: without it MemFerry measures no norm and none is logged).

Checkpoints are Trainer's own (``save_strategy``, ``resume_from_checkpoint``): ``checkpoint-N/``
holds the engine's weights as a ``save_pretrained`` folder (``from_pretrained`` loads it; a PEFT
model's is its adapter), ``optimizer.pt`` the engine's optimizer state (fp32 masters, moments and
step counts), and Trainer's scheduler, RNG and trainer state. Resuming with a fresh engine built
over the same model loads the weights, then the optimizer state: the run goes on exactly as the
uninterrupted one. A PEFT model's adapters come back through their fp32 masters in ``optimizer.pt``.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, TRAINING_ARGS_NAME

from .hf_models import save_hf_folder, tied_names
from .sequence_scaling import longest, sample_shape

__all__ = ["MemFerryModel", "MemFerryTrainer", "check_trainer_args", "memferry_trainer"]


class LoadResult(NamedTuple):
    """What ``nn.Module.load_state_dict`` returns: names the state lacked, and names the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None))


def _base_model(model: nn.Module) -> nn.Module:
    """A PEFT model's base model (what Trainer inspects), else ``model``."""
    return model.get_base_model() if _is_peft(model) else model


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """What Trainer would decide for ``model`` itself: may it be given ``num_items_in_batch``?"""
    inner = _base_model(model)
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
    Trainer saves and loads it through :meth:`save_pretrained` (``MemFerryTrainer._save``) and
    :meth:`load_state_dict`.
    """

    #: What Trainer asks of a model whose load reported missing names (none are ignored here).
    _keys_to_ignore_on_save = None

    def __init__(self, engine: Any) -> None:
        super().__init__()
        inner = engine.model
        object.__setattr__(self, "engine", engine)  # not a submodule (see the class docstring)
        self.config = getattr(inner, "config", None)
        self.main_input_name = getattr(inner, "main_input_name", "input_ids")
        self.accepts_loss_kwargs = _accepts_loss_kwargs(inner)
        loss_type = getattr(_base_model(inner), "loss_type", None)
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
        """The engine's weights (full host tensors, waits for pending updates; a tied weight once)."""
        return self.engine.state_dict()["model"]

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> LoadResult:
        """Load weights by the model's parameter names into the engine (its fp32 masters; moments
        and step counts stay). A tied weight's second name (``lm_head.weight``) is taken as the
        first; with ``strict=False`` names the state lacks keep their values. ``assign`` is ignored:
        the engine's buffers are always written in place."""
        current = {name for sh in self.engine.shadow.shadows for name, _ in sh.unit.params}
        aliases = tied_names(self.engine.model)
        given = {k: v for k, v in state_dict.items() if k not in aliases}
        missing = sorted(set(current) - set(given))
        unexpected = sorted(set(given) - set(current))
        if strict and (missing or unexpected):
            raise RuntimeError(f"the state does not match the MemFerry model: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]} ({len(missing)} + {len(unexpected)} names)")
        known = {k: v for k, v in given.items() if k in current}
        if missing:  # a partial state (a shard of a sharded checkpoint): the rest keeps its values
            known = {**self.engine.state_dict()["model"], **known}
        self.engine.load_state_dict({"model": known})
        return LoadResult(missing, unexpected)

    def save_pretrained(self, save_directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """Write the engine's weights (or ``state_dict``) as the wrapped model's ``save_pretrained``
        folder: config and safetensors that ``from_pretrained`` loads (a tied weight written once);
        a PEFT model writes its adapter. ``kwargs`` go to that ``save_pretrained`` (``max_shard_size``...)."""
        weights = state_dict if state_dict is not None else self.engine.state_dict()["model"]
        save_hf_folder(self.engine.model, Path(save_directory), weights, **kwargs)


def check_trainer_args(args: Any, engine: Any) -> None:
    """Refuse ``TrainingArguments`` under which Trainer would not train ``engine`` as asked (one-line ValueError)."""
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        raise ValueError(f"TrainingArguments.max_grad_norm={args.max_grad_norm} would clip nothing (MemFerry holds the "
                         f"gradients): give max_grad_norm=0 and clip with MemFerry's AdamW(max_grad_norm=...), whose "
                         f"pre-clip norm Trainer then logs as grad_norm")
    if args.gradient_accumulation_steps != engine.micro.steps:
        raise ValueError(f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps} differs from "
                         f"the engine's accumulation_steps={engine.micro.steps}: give both the same number")
    if args.load_best_model_at_end and _is_peft(engine.model):
        raise ValueError("TrainingArguments.load_best_model_at_end=True: Trainer cannot load a best PEFT adapter into a "
                         "MemFerry engine; leave it False and resume from the best checkpoint-N/ "
                         "(trainer.state.best_model_checkpoint)")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ValueError(f"Trainer would spread this MemFerry model over {max(args.world_size, args.n_gpu)} devices; "
                         f"run one process on one visible device (MemFerry's data parallelism is its own)")
    # transformers 5.x renamed it activation_checkpointing (the old name a deprecated alias, gone in v6)
    named = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, None)), None)
    if named:
        raise ValueError(f"TrainingArguments.{named}=True: MemFerry's plan recomputes blocks itself "
                         "(plan='auto' where the budget needs it, or a plan with +recompute); leave it False")
    optim = str(getattr(args.optim, "value", args.optim))  # an OptimizerNames member
    if not optim.startswith("adamw"):
        raise ValueError(f"TrainingArguments.optim={optim!r} would not be used: MemFerry runs its own AdamW "
                         f"(give the engine AdamW(...) and leave optim at its default)")
    # Trainer builds no optimizer of its own here: these arguments would be silently unused where
    # they say something other than the engine's AdamW (left at Trainer's defaults they say nothing).
    cfg = engine.cfg
    for name, theirs, ours, what in (("learning_rate", args.learning_rate, cfg.lr, "lr"),
                                     ("weight_decay", args.weight_decay, cfg.weight_decay, "weight_decay"),
                                     ("adam_beta1", args.adam_beta1, cfg.betas[0], "betas[0]"),
                                     ("adam_beta2", args.adam_beta2, cfg.betas[1], "betas[1]"),
                                     ("adam_epsilon", args.adam_epsilon, cfg.eps, "eps")):
        if theirs != _TRAINER_DEFAULTS[name] and theirs != ours:
            raise ValueError(f"TrainingArguments.{name}={theirs} differs from the engine's AdamW {what}={ours}, which "
                             f"is the one used (Trainer's scheduler scales the engine's rate): give both the same")


#: TrainingArguments' own defaults: an argument left at one was not asked for.
_TRAINER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}


class MemFerryTrainer(transformers.Trainer):
    """The ``transformers.Trainer`` :func:`memferry_trainer` makes: Trainer's own loop, with its
    model saves written as the engine's ``save_pretrained`` folder and MemFerry's gradient norm logged.

    ``self.model`` is a :class:`MemFerryModel` and ``self.optimizer`` the engine's optimizer handle,
    whose ``state_dict`` Trainer writes to ``optimizer.pt`` and loads on resume.
    """

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's model save (``save_model``, every ``checkpoint-N/``): the engine's weights as a
        ``save_pretrained`` folder (Trainer would write a bare state dict for a model that is not a
        ``PreTrainedModel``), then what Trainer writes beside it: tokenizer and training arguments."""
        out = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        self.model.save_pretrained(out, state_dict=state_dict)
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Trainer's weight load on resume. A full model's folder goes into the engine through
        :meth:`MemFerryModel.load_state_dict` (Trainer's own load); a PEFT model's adapters come back
        with the optimizer state, whose fp32 masters are the adapters' weights, so it must be there."""
        if not _is_peft(self.model.engine.model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        elif not os.path.isfile(os.path.join(resume_from_checkpoint, OPTIMIZER_NAME)):
            raise ValueError(f"{resume_from_checkpoint} has no {OPTIMIZER_NAME}: a MemFerry PEFT model resumes its "
                             f"adapters from the optimizer state; resume from a checkpoint saved without save_only_model")

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> tuple[list, Any]:
        """Trainer's fetch of a step's micro-batches, then the engine fitted to the longest of them
        (:meth:`~strategies.memferry.engine.MemFerry.fit_shape`): collators that pad each batch
        to its longest row vary the lengths, and a plan made for a shorter sample could run out of
        memory mid-step, where it cannot be made again."""
        samples, num_items = super().get_batch_samples(*args, **kwargs)  # (epoch_iterator, num_batches, device)
        shapes = [sample_shape(b) for b in samples if isinstance(b, Mapping)]
        if shapes and self.model.training:
            self.model.engine.fit_shape(*longest(shapes))
        return samples, num_items

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with ``grad_norm`` the engine's pre-clip norm of the step just taken
        (Trainer sees no gradients: it would log 0); left out when the engine does not clip."""
        if "grad_norm" in logs:
            norm = self.model.engine.last_grad_norm
            if norm is None:
                del logs["grad_norm"]
            else:
                logs["grad_norm"] = norm
        super().log(logs, *args, **kwargs)


def memferry_trainer(engine: Any, args: Any, **trainer_kwargs: Any) -> MemFerryTrainer:
    """A :class:`MemFerryTrainer` training ``engine`` (see the module docstring), after
    :func:`check_trainer_args`. ``trainer_kwargs`` go to Trainer (``train_dataset``,
    ``eval_dataset``, ``data_collator``, ``callbacks``...); not ``model`` or ``optimizers``: the
    engine is both. Trainer's own scheduler (``args.lr_scheduler_type``, ``warmup_steps``...)
    drives the engine's rate."""
    check_trainer_args(args, engine)
    taken = sorted({"model", "optimizers", "optimizer_cls_and_kwargs"} & set(trainer_kwargs))
    if taken:
        raise ValueError(f"memferry_trainer makes {taken} from the engine: leave them out")
    trainer = MemFerryTrainer(model=MemFerryModel(engine), args=args, optimizers=(engine.as_torch_optimizer(), None),
                              **trainer_kwargs)
    # Wrapped now without device placement: accelerate's wrapper would otherwise round-trip the
    # optimizer's state_dict (every fp32 master and moment) through the device, a full copy there.
    # The accelerator keeps its placement: data loaders that dispatch batches (an IterableDataset's)
    # know the last batch's size, and Trainer's eval_loss weights it by that.
    trainer.optimizer = trainer.accelerator.prepare_optimizer(trainer.optimizer, device_placement=False)
    return trainer
