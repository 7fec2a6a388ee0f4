"""A ``torch.optim.Optimizer``-shaped handle on a MemFerry engine, for code that drives an
optimizer: learning-rate schedulers (``LambdaLR``...), ``step()`` / ``zero_grad()`` loops.

    opt = engine.as_torch_optimizer()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    for x, y in data:
        engine.backward(loss_fn(engine(x), y)); opt.step(); sched.step()

``param_groups`` has one group per weight-decay class (``[decay, no decay]``, the second with
``weight_decay`` 0). The engine reads the groups' ``lr`` when a step's last backward starts
(updates begin as gradients land) and again at ``step()`` (held updates, with clipping, run
then). The engine has one learning rate: groups with different rates are refused.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["MemFerryOptimizer"]


class MemFerryOptimizer(torch.optim.Optimizer):
    """See the module docstring; made by :meth:`MemFerry.as_torch_optimizer`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        cfg = engine.cfg
        decay = [p for s in engine.shadow.shadows for _, p in s.unit.trainable[: s.unit.n_decay]]
        plain = [p for s in engine.shadow.shadows for _, p in s.unit.trainable[s.unit.n_decay:]]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
        defaults = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
        super().__init__([g for g in groups if g["params"]], defaults)
        self._applied_lr = cfg.lr

    def current_lr(self) -> float:
        """The groups' learning rate (one for all groups, or a one-line ValueError)."""
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:
            raise ValueError(f"MemFerry has one learning rate for all parameters, the param_groups ask for {sorted(lrs)}: "
                             "give every group the same lr (one lambda for LambdaLR)")
        return lrs.pop()

    def apply_lr(self) -> None:
        """Hand the groups' learning rate to the engine when it changed (queued behind earlier updates)."""
        lr = self.current_lr()
        if lr != self._applied_lr:
            self.engine.set_lr(lr)
            self._applied_lr = lr

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """The engine's :meth:`~strategies.memferry.engine.MemFerry.step`; a closure runs first
        (forward and ``engine.backward``) and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: MemFerry takes each gradient home and clears it as it lands."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": per-parameter-name fp32 masters, moments and steps, "param_groups": hyperparameters}``
        (waits for pending updates; a collective under data parallelism)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": self.engine.state_dict()["optimizer"], "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` gave: the groups' hyperparameters, then the optimizer state."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        if state_dict.get("state"):
            self.engine.load_state_dict({"model": self.engine.state_dict()["model"], "optimizer": state_dict["state"]})
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.apply_lr()
