"""The strategies ``xpu train`` ships: MemFerry, and the plain PyTorch reference (``torch``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checks import positive_number
from .config import TrainConfig, TrainConfigError, resolve_dtype
from .registry import StrategySpec, TrainEngine

__all__ = ["TorchEngine", "MemFerryEngine", "MEMFERRY", "TORCH"]


def _check_grad_norm(options: dict[str, Any]) -> None:
    value = options.get("max_grad_norm")
    if value is not None:
        positive_number("strategy.options.max_grad_norm", value, TrainConfigError)


def _check_memferry(options: dict[str, Any], config: TrainConfig) -> None:
    from strategies.memferry import Plan

    _check_grad_norm(options)
    if not isinstance(options["plan"], str):
        raise TrainConfigError(f"strategy.options.plan must be a plan name such as 'prefetch+recompute' or 'auto', "
                               f"got {options['plan']!r}")
    chunks = options["loss_chunks"]
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise TrainConfigError(f"strategy.options.loss_chunks must be a positive integer (1: the loss over all tokens "
                               f"at once) or auto (slices when the fp32 logits are large for device_budget), "
                               f"got {chunks!r}")
    rate = options["clip_fire_rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise TrainConfigError(f"strategy.options.clip_fire_rate is the share of steps expected to clip, from 0 to 1; "
                               f"got {rate!r}")
    if rate and options.get("max_grad_norm") is None:
        raise TrainConfigError("strategy.options.clip_fire_rate weighs steps whose clip fires, but max_grad_norm is "
                               "not set: set strategy.options.max_grad_norm, or leave clip_fire_rate at 0")
    split = options["split_update"]
    if split is not None and not isinstance(split, bool):
        raise TrainConfigError(f"strategy.options.split_update must be true, false or null (on where clipping is), "
                               f"got {split!r}")
    if not isinstance(options["compile_blocks"], bool):
        raise TrainConfigError(f"strategy.options.compile_blocks must be true or false (blocks through "
                               f"torch.compile), got {options['compile_blocks']!r}")
    margin = options["memory_margin"]
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise TrainConfigError(f"strategy.options.memory_margin must lie in [0, 1), got {margin!r}")
    n_blocks = config.n_blocks()
    if n_blocks is not None and options["plan"] != "auto":
        try:
            Plan.from_spec(options["plan"], n_blocks)
        except ValueError as exc:
            # Plan.from_spec knows only fixed plans; 'auto' (the scheduler) is MemFerry's, so added here.
            raise TrainConfigError(f"strategy.options.plan: {exc}; or auto (the scheduler picks a plan that fits "
                                   f"device_budget)") from None


def _build_memferry(model: nn.Module, config: TrainConfig, backend: Any, device: int) -> TrainEngine:
    from strategies.memferry import AdamW, MemFerry, Plan

    o, opts = config.optimizer, config.strategy.options
    cfg = AdamW(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=opts["max_grad_norm"],
                clip_fire_rate=float(opts["clip_fire_rate"]), split_update=opts["split_update"])
    sample = None
    if opts["plan"] == "auto" or config.device_budget is not None:
        # the scheduler profiles one batch of the run's shape (its values do not matter), and the
        # engine rehearses a step on it under the budget (a given plan over it is refused)
        g = torch.Generator().manual_seed(config.seed)
        tokens = torch.randint(0, config.vocab() or 256, (config.batch, config.seq + 1), generator=g)
        sample = (tokens[:, :-1], tokens[:, 1:])
    plan: Any = "auto" if opts["plan"] == "auto" else Plan.from_spec(opts["plan"], len(model.blocks))
    chunks = _loss_chunks(opts["loss_chunks"], model, config, backend, device)
    if chunks > 1:
        if not hasattr(model, "loss_chunks"):
            raise TrainConfigError("strategy.options.loss_chunks needs a model that slices its loss (gpt, llama or hf)")
        model.loss_chunks = chunks
    # MemFerry's set_lr is queued behind pending host updates.
    return MemFerryEngine(MemFerry(model, optim=cfg, device_budget=config.device_budget, plan=plan, backend=backend,
                                   device=device, sample=sample, memory_margin=float(opts["memory_margin"]),
                                   compute_dtype=resolve_dtype(config, backend)[1],
                                   blocks=model.blocks,
                                   accumulation_steps=config.accumulation_steps,
                                   compile_blocks=opts["compile_blocks"]))  # blocks named: a 1-block model has no list to find


def _loss_chunks(option: Any, model: nn.Module, config: TrainConfig, backend: Any, device: int) -> int:
    """``loss_chunks`` as given, or for ``auto`` the fewest token slices whose fp32 logits each
    take at most 1/32 of the device budget (``cost.auto_loss_chunks``; 1 for a model that
    cannot slice its loss, or a small vocabulary)."""
    if option != "auto":
        return int(option)
    from strategies.memferry.cost import auto_loss_chunks
    from strategies.memferry.hf_models import head_shape

    vocab = head_shape(model)[0]
    if not vocab or not hasattr(model, "loss_chunks"):
        return 1
    budget = config.device_budget if config.device_budget is not None else backend.mem_info(device)[0]
    return auto_loss_chunks(config.batch * config.seq, vocab, budget)


class MemFerryEngine:
    """A MemFerry engine as a :class:`TrainEngine`: adds :meth:`train_batch`, and runs a step that
    ran out of device memory again under a plan made with a larger margin
    (:func:`~strategies.memferry.oom_recovery.replan_after_oom`, at most ``ATTEMPTS`` times a run);
    everything else is MemFerry's own."""

    def __init__(self, engine: Any) -> None:
        from strategies.memferry.oom_recovery import ReplanningSteps

        self.engine = engine
        self._replanning = ReplanningSteps(engine)

    @property
    def replans(self) -> int:
        """Steps run again after running out of device memory."""
        return self._replanning.replans

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)  # eval_loss, set_lr, state_dict, plan, ...

    def train_step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """MemFerry's ``train_step``, run again after an out-of-memory error it can re-plan."""
        return self._replanning.run(lambda: self.engine.train_step(inputs, targets))

    def train_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward each micro-batch on ``loss / N``, then one step; the mean loss
        (detached); run again from the first micro-batch after an out-of-memory error it can re-plan."""
        return self._replanning.run(lambda: self._batch(micro_batches))

    def _fit(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fit the plan to the step's longest micro-batch before its first runs (``batch_growth.py``)."""
        from strategies.memferry.sequence_scaling import longest, sample_shape

        self.engine.fit_shape(*longest([sample_shape(inputs) for inputs, _ in micro_batches]))

    def _batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self._fit(micro_batches)
        n, total = len(micro_batches), None
        for inputs, targets in micro_batches:
            loss = self.engine(inputs, targets)
            self.engine.backward(loss / n)
            total = loss.detach() if total is None else total + loss.detach()
        self.engine.step()
        return total / n


class TorchEngine:
    """The ``torch`` reference: the model and ``torch.optim.AdamW`` all on the device, weights in the compute dtype."""

    def __init__(self, model: nn.Module, config: TrainConfig, backend: Any, device: int) -> None:
        o, opts = config.optimizer, config.strategy.options
        self.backend, self.device = backend, device
        self.max_grad_norm = opts["max_grad_norm"]
        # Copy every tensor with the backend rather than model.to(device): on the cpu backend
        # ``to`` would be a no-op and the weights would not count against the virtual device.
        with backend.device_scope(device):
            for p in model.parameters():
                p.data = backend.to_device(p.data, device)
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    setattr(module, name, backend.to_device(buf, device))
        self.model = model
        self.model.recompute = bool(opts["recompute"])  # CausalLM's per-block checkpointing
        self.model.train()
        from strategies.weight_decay import param_groups

        # Biases and norm weights get no decay, as in HF Trainer and MemFerry; frozen weights are left out.
        self.optimizer = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr, betas=o.betas,
                                           eps=o.eps)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward, optional clipping, AdamW step."""
        with self.backend.device_scope(self.device):
            inputs, targets = self.backend.to_device(inputs, self.device), self.backend.to_device(targets, self.device)
            loss = self.model(inputs, targets)
            loss.backward()
            if self.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def train_batch(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate the gradients of ``loss / N`` over the N micro-batches, clip them, step once; the mean loss."""
        n, total = len(micro_batches), None
        with self.backend.device_scope(self.device):
            for inputs, targets in micro_batches:
                inputs = self.backend.to_device(inputs, self.device)
                targets = self.backend.to_device(targets, self.device)
                loss = self.model(inputs, targets)
                (loss / n).backward()
                total = loss.detach() if total is None else total + loss.detach()
            if self.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / n

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The loss of one batch under ``torch.no_grad`` (the model stays in training mode: it has no dropout)."""
        with self.backend.device_scope(self.device), torch.no_grad():
            inputs, targets = self.backend.to_device(inputs, self.device), self.backend.to_device(targets, self.device)
            return float(self.model(inputs, targets))

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next step."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Host copies of the weights (``copy=False``: host weights as they are), and torch's optimizer state."""
        self.synchronize()
        return {"model": {k: v.to("cpu", copy=copy) for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load weights and optimizer state."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def synchronize(self) -> None:
        """Wait for the device."""
        self.backend.synchronize(self.device)

    def close(self) -> None:
        """Drop the device copies."""
        self.model, self.optimizer = None, None  # type: ignore[assignment]


def _check_torch(options: dict[str, Any], config: TrainConfig) -> None:
    _check_grad_norm(options)
    if not isinstance(options["recompute"], bool):
        raise TrainConfigError(f"strategy.options.recompute must be true or false, got {options['recompute']!r}")


#: strategy name -> spec; adding a strategy (``mpress``) is one line here plus its builder.


MEMFERRY = StrategySpec(_build_memferry, {"plan": "prefetch", "max_grad_norm": None, "loss_chunks": "auto",
                                          "memory_margin": 0.10, "clip_fire_rate": 0.0, "split_update": None,
                                          "compile_blocks": False},
                        "MemFerry: parameters homed in host memory, per-block plan, host AdamW", _check_memferry,
                        takes_budget=True, fp32_model=True, data_parallel=True)
TORCH = StrategySpec(TorchEngine, {"max_grad_norm": None, "recompute": False},
                     "plain PyTorch reference: model and torch AdamW all on the device", _check_torch)
