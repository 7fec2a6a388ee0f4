"""The training strategies by name: what ``strategy.name`` in a config selects.

A strategy is a :class:`StrategySpec` (its builder, options, checks) registered under a name,
bound lazily (``"module:SPEC"``), like backends and commands (:mod:`xpu.plugins`); another
package adds one through the ``xpu.train_strategies`` entry-point group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import nn

from xpu.plugins import PluginRegistry

from .config import TrainConfigError

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["TrainEngine", "StrategySpec", "STRATEGIES", "register_strategy", "get_strategy"]


# ---------------------------------------------------------------------------------- strategies
class TrainEngine(Protocol):
    """What a strategy builder returns; ``MemFerry`` has this shape."""

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward and update; returns the loss (detached, any device)."""

    def train_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One update from several micro-batches (gradient accumulation): the gradient of their mean loss.

        Returns the mean of the micro-batch losses (detached, any device). :func:`train` calls it
        when ``accumulation_steps > 1`` (else :meth:`train_step`).
        """

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The loss of one batch without gradients or updates (held-out evaluation)."""

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next update."""

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything needed to continue training (weights and optimizer state); ``copy=False``:
        tensors may be the engine's own buffers, valid until the next step (a checkpoint's writer)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave."""

    def synchronize(self) -> None:
        """Wait for pending work."""

    def close(self) -> None:
        """Release what the engine holds."""


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy.

    Attributes:
        build: ``build(model, config, backend, device) -> TrainEngine``; the model is built on
            the host in the compute dtype (in fp32 with ``fp32_model``), seeded; the device
            memory cap is already set.
        options: option names and defaults (unknown options in a config are errors).
        description: one line for listings and errors.
        check: ``check(options, config)`` raising :class:`TrainConfigError` for bad option
            values, run at validation, before anything is built.
        takes_budget: the builder enforces ``device_budget`` itself (else the trainer sets the cap).
        fp32_model: the builder takes the model in fp32 and computes in the config's dtype, so
            its fp32 masters start from the fp32 initial values, not from their bf16 roundings.
        data_parallel: the engine trains data-parallel over torch.distributed's default group
            when it is initialised (``xpu train`` under torchrun); others are refused there.
    """

    build: Callable[[nn.Module, TrainConfig, Any, int], TrainEngine]
    options: dict[str, Any]
    description: str
    check: Callable[[dict[str, Any], TrainConfig], None] | None = None
    takes_budget: bool = False
    fp32_model: bool = False
    data_parallel: bool = False


#: The strategies; each names a :class:`StrategySpec`.
STRATEGIES = PluginRegistry("strategy", group="xpu.train_strategies")


def register_strategy(name: str, target: str) -> None:
    """Make ``strategy: NAME`` build with the :class:`StrategySpec` at ``target`` (``"module:ATTR"``)."""
    STRATEGIES.register(name, target)


def get_strategy(name: str) -> StrategySpec:
    """The spec of strategy ``name``.

    Raises:
        TrainConfigError: no such strategy; the message lists the valid ones.
    """
    if name not in STRATEGIES.plugins():
        raise TrainConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(STRATEGIES.names())}")
    return STRATEGIES.load(name)


register_strategy("memferry", "strategies.training.engines:MEMFERRY")
register_strategy("torch", "strategies.training.engines:TORCH")
