"""What a benchmarked system is given (:class:`SystemContext`) and what it must do (:class:`BenchSystem`).

A system's factory is called once inside a fresh worker process, under
``backend.device_scope(ctx.device_index)`` and after the device memory cap is set. It
builds its model and optimizer; then the worker calls :meth:`BenchSystem.step` once per
training step, with a device synchronisation before and after for timing.

With the scenario's ``accumulation_steps`` N > 1 a step's ``inputs``/``targets`` hold ``N * batch``
rows, micro-batch ``i`` being rows ``i*batch .. (i+1)*batch-1`` (:func:`micro_batches`); the step
runs N forward/backwards on ``loss / N`` and one optimizer update, and returns the mean of the
N micro-batch losses.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from strategies.models import CausalLM, build_model
from xpu.spans import span

__all__ = ["SystemContext", "BenchSystem", "phase", "forward_backward", "module_step", "engine_step", "DTYPES",
           "init_single_process_group", "micro_batches", "set_recompute"]

#: scenario dtype names -> torch dtypes
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class SystemContext:
    """Everything a system needs to set itself up.

    Attributes:
        backend: the process's :class:`xpu.Backend`.
        device_index: the device to train on.
        family: model family (``gpt``, ``llama``, ``hf``).
        dims: model dimensions, ``seq`` included (see :mod:`strategies.models`).
        dtype: the compute dtype (bf16 on accelerators by default, fp32 on the cpu backend).
        batch: micro-batch size (rows per forward/backward).
        seq: sequence length.
        accumulation_steps: micro-batches per optimizer step (a step's inputs hold this many
            micro-batches of ``batch`` rows).
        optimizer: AdamW hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``).
        options: this system's options, defaults filled in.
        seed: the run's seed (already applied with ``torch.manual_seed`` before the factory).
    """

    backend: Any
    device_index: int
    family: str
    dims: dict[str, Any]
    dtype: torch.dtype
    batch: int
    seq: int
    optimizer: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    accumulation_steps: int = 1

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` of the training device."""
        return self.backend.device(self.device_index)

    def build_model(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> CausalLM:
        """The scenario's model with parameters created on ``device`` in ``dtype`` (default: host, fp32).

        With no ``device`` the model is host memory on every backend: the cpu backend's
        virtual devices would otherwise count a model built inside the worker's device scope.
        """
        host_scope = getattr(self.backend, "host_scope", None) if device is None else None
        with host_scope() if host_scope is not None else contextlib.nullcontext():
            return build_model(self.family, device=device, dtype=dtype, **self.dims)

    def adamw_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.optim.AdamW`` from the scenario's optimizer section."""
        o = self.optimizer
        return {"lr": o["lr"], "betas": tuple(o["betas"]), "eps": o["eps"], "weight_decay": o["weight_decay"]}

    def adamw_params(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        """``model``'s trainable parameters as AdamW groups, biases and norm weights without
        weight decay (:func:`strategies.weight_decay.param_groups`, as MemFerry and HF's Trainer
        group them), so every system decays the same parameters."""
        from strategies.weight_decay import param_groups

        return param_groups(model, self.optimizer["weight_decay"])


class BenchSystem(abc.ABC):
    """One system under test, set up and ready to train.

    Attributes:
        optimizer_on_host: True when the optimizer step runs on the CPU (timelines put the
            ``bench:optimizer`` phase on the "CPU optimizer" lane).
        tracks_device_memory: False when the backend's allocator statistics cannot see the
            system's device memory (the row's peak device memory is then left empty).
        notes: free-form remarks copied into the row (e.g. what an option changed).
        metrics: named figures copied into the row as its own fields (read after the notes).
    """

    optimizer_on_host: bool = False
    tracks_device_memory: bool = True
    notes: str = ""

    @property
    def metrics(self) -> dict[str, Any]:
        """Row fields of this system's own (none by default)."""
        return {}

    @abc.abstractmethod
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Run one full training step (forward, backward, optimizer); return the loss (a scalar tensor).

        A system that times one part of a step alone (e.g. the host optimizer) returns None:
        its row then has no loss.

        Wrap the parts in :func:`phase` (``forward``, ``backward``, ``optimizer``) so timelines
        can label them. Do not synchronise: the worker does, around the step.
        """

    def wrap_up(self) -> None:
        """Called once after the last training step, before the row's notes are read (untimed):
        e.g. export the trained model and check that it reloads, saying so in :attr:`notes`."""

    def finish(self) -> None:
        """Wait for work a step left running off the device (e.g. host optimizer threads).

        The worker calls it before it ends a profiled step's trace, so that work is in the timeline.
        """

    def close(self) -> None:
        """Release what the system holds (process groups, engines); called once at the end."""


def set_recompute(model: CausalLM, on: bool) -> str:
    """Turn per-block activation checkpointing on or off; return what the row's notes should say ("" when off).

    One switch for every system (``torch``, FSDP2, DeepSpeed), through :attr:`CausalLM.recompute`:
    an HF model gets its own ``gradient_checkpointing_enable`` (``use_reentrant=False``), our GPT
    and Llama families a non-reentrant ``torch.utils.checkpoint`` around each block. Set it
    before a library wraps the model (before ``fully_shard``, ``deepspeed.initialize``): the
    order torch's FSDP2 tests and HF's Trainer use.
    """
    model.recompute = bool(on)
    if not on:
        return ""
    how = "HF gradient checkpointing" if hasattr(model, "hf") else "torch.utils.checkpoint"
    return f"recompute per block ({how}, non-reentrant)"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label a part of a step (``bench:<name>``) in the profiler timeline."""
    with span(lambda: f"bench:{name}"):
        yield


def micro_batches(inputs: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``n`` equal micro-batches of a step's rows, in order (views, no copies).

    Raises:
        ValueError: the rows do not split into ``n`` equal micro-batches.
    """
    if n < 1 or inputs.shape[0] % n:
        raise ValueError(f"a step's {inputs.shape[0]} rows do not split into {n} equal micro-batches")
    return list(zip(inputs.chunk(n), targets.chunk(n)))


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    return losses[0] if len(losses) == 1 else torch.stack([l.float() for l in losses]).mean()


def _accumulate(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, autocast: Any,
                accumulation: int) -> torch.Tensor:
    """Forward and backward of ``loss / N`` over the ``accumulation`` micro-batches (gradients summed); the mean loss."""
    losses = []
    for x, y in micro_batches(inputs, targets, accumulation):
        with phase("forward"), autocast():
            loss = model(x, y)
        with phase("backward"):
            (loss / accumulation if accumulation > 1 else loss).backward()
        losses.append(loss.detach())
    return _mean(losses)


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     autocast: Any = contextlib.nullcontext, accumulation: int = 1) -> torch.Tensor:
    """Labelled forward and backward of a plain module (``model(inputs, targets)`` returns the
    loss) over ``accumulation`` micro-batches; the gradients are dropped, so repeated calls
    time compute alone. Returns the mean micro-batch loss."""
    loss = _accumulate(model, inputs, targets, autocast, accumulation)
    for p in model.parameters():
        p.grad = None
    return loss


def module_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
                autocast: Any = contextlib.nullcontext, accumulation: int = 1) -> torch.Tensor:
    """One labelled step of a plain module and a torch optimizer: ``model(inputs, targets)``
    returns the loss; over ``accumulation`` micro-batches, backward of ``loss / N`` (gradients
    summed); ``optimizer.step()`` once and zeroed gradients. Returns the mean micro-batch loss.
    """
    loss = _accumulate(model, inputs, targets, autocast, accumulation)
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def engine_step(engine: Any, inputs: torch.Tensor, targets: torch.Tensor, accumulation: int = 1,
                step_each: bool = False) -> torch.Tensor:
    """One labelled step of an engine with DeepSpeed's calling convention (MemFerry has it too):
    ``loss = engine(inputs, targets)``, ``engine.backward(loss)``, ``engine.step()``.

    Over ``accumulation`` micro-batches: MemFerry's convention (``step_each=False``) is
    ``engine.backward(loss / N)`` per micro-batch and one ``engine.step()``; DeepSpeed's
    (``step_each=True``; its config's ``gradient_accumulation_steps`` = N) is
    ``engine.backward(loss)`` (DeepSpeed divides by N itself) and ``engine.step()`` after every
    micro-batch (it updates on the N-th only). Returns the mean micro-batch loss.
    """
    losses = []
    for x, y in micro_batches(inputs, targets, accumulation):
        with phase("forward"):
            loss = engine(x, y)
        with phase("backward"):
            engine.backward(loss if step_each or accumulation == 1 else loss / accumulation)
        losses.append(loss.detach())
        if step_each:
            with phase("optimizer"):
                engine.step()
    if not step_each:
        with phase("optimizer"):
            engine.step()
    return _mean(losses)


def init_single_process_group(backend_name: str) -> None:
    """Start a one-process ``torch.distributed`` group (rank 0 of 1) if none is running.

    FSDP2 and DeepSpeed both need a process group even alone; it is joined through
    :func:`xpu.dist.init_local_group` (a file rendezvous, nothing listening beyond loopback).
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        from xpu.dist import init_local_group, rendezvous_port

        # Through xpu.dist's file rendezvous (no socket listening beyond loopback; a TCP store on
        # the worker's MASTER_PORT would listen on every interface), with a fresh reserved id:
        # a crashed run's file is never reused. MASTER_* stay set for those that read them.
        init_local_group(backend_name, 0, 1, rendezvous_port(), timeout_s=1800.0)  # torch's default timeout
