"""MemFerry as a benchmarked system (``xpu bench`` name ``memferry``).

Options:
    plan: a :meth:`~strategies.memferry.config.Plan.from_spec` name, e.g.
        ``prefetch+recompute`` or ``device15+recompute``, or ``auto``: the scheduler profiles
        one batch and picks the plan under the scenario's device cap (its prediction goes in
        the row's notes, the explained plan in the worker log).
    max_grad_norm: global-norm clipping (None: off).
    host_threads: CPU threads of the host optimizer (None: torch's default).
    host_kernel: ``auto``, ``torch`` or ``single-pass`` (see ``host_kernel.py``).
    memory_margin: the scheduler's fragmentation margin on predicted peak memory (plan auto).
    loss_chunks: compute the model's loss over this many token slices, each slice's logits
        recomputed in backward (``CausalLM.loss_chunks``): frees the fp32 logits' memory for
        the scheduler to spend on device-homed blocks. 1: the model as the baselines run it.

The row's notes end with the host optimizer's time per step by phase (milliseconds,
averaged over every step run), which says whether the CPU or the device bounds a step, and its
rate per parameter beside the rate the scheduler planned with (plan ``auto``).
"""
from __future__ import annotations

import torch

from .base import BenchSystem, SystemContext, engine_step, phase

from strategies.memferry import AdamW, MemFerry, Plan

__all__ = ["MemFerrySystem", "make"]


class MemFerrySystem(BenchSystem):
    """The model built on the host, handed to a :class:`MemFerry` engine."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext) -> None:
        measure = ctx.options["measure"]
        if measure not in ("step", "host-optimizer"):
            raise ValueError(f"memferry: measure must be 'step' or 'host-optimizer', got {measure!r}")
        # Built in fp32 and computed in the scenario's dtype, as the offload baselines keep it:
        # the masters start from the fp32 initial values, not from their bf16 roundings.
        model = ctx.build_model(dtype=torch.float32)
        chunks = int(ctx.options["loss_chunks"])
        if chunks < 1 or (chunks > 1 and not hasattr(model, "loss_chunks")):
            raise ValueError(f"memferry: loss_chunks must be >= 1 and needs a model with sliced-loss support, got {chunks}")
        if chunks > 1:
            model.loss_chunks = chunks
        self._optimizer_alone = measure == "host-optimizer"
        spec = "prefetch" if self._optimizer_alone else ctx.options["plan"]
        cfg = AdamW(**ctx.adamw_kwargs(), max_grad_norm=ctx.options["max_grad_norm"],
                    host_threads=ctx.options["host_threads"], host_kernel=ctx.options["host_kernel"])
        sample = None
        if spec == "auto":  # the scheduler profiles one batch of the scenario's shape under the device cap
            vocab = ctx.dims.get("vocab", 256)
            tokens = torch.randint(0, vocab, (ctx.batch, ctx.seq + 1), generator=torch.Generator().manual_seed(ctx.seed))
            sample = (tokens[:, :-1], tokens[:, 1:])
        plan = spec if spec == "auto" else Plan.from_spec(spec, len(model.blocks))
        cap = ctx.backend.memory_cap(ctx.device_index)
        self.engine = MemFerry(model, optim=cfg, plan=plan, backend=ctx.backend, device=ctx.device_index,
                               sample=sample, device_budget=cap, memory_margin=float(ctx.options["memory_margin"]),
                               compute_dtype=ctx.dtype, blocks=model.blocks)  # named: a 1-block model has no list to find
        self._plan_note = f"plan={spec}, host kernel {self.engine.optimizer.kernel.name}" + (
            f", loss in {chunks} recomputed slices" if chunks > 1 else "")
        if spec == "auto":
            predicted = self.engine.plan.predicted_step_s
            self._plan_note += f" (predicted {predicted:.3f} s)" if predicted is not None else ""
            print(f"memferry plan chosen by the scheduler:\n{self.engine.plan.describe()}", flush=True)
        if self._optimizer_alone:
            self._plan_note = f"host AdamW alone over every unit, host kernel {self.engine.optimizer.kernel.name}"
            for shadow in self.engine.shadow.shadows:
                shadow.grad_stage.fill_(1e-3)  # gradients "landed"; the values only need to be finite
        self._steps = 0

    @property
    def notes(self) -> str:
        """The plan, and the host optimizer's milliseconds per step by phase."""
        if not self._steps:
            return self._plan_note
        # The last step's updates may still be running: wait, or the per-step averages below
        # would count a part of that step's host work as if it were all of it.
        self.engine.optimizer.wait_all()
        phases = ", ".join(f"{k} {v * 1e3 / self._steps:.1f}" for k, v in self.engine.optimizer.time_s.items())
        measured, planned = self.engine.host_rate()
        rate = "" if measured is None else f"; host AdamW {measured * 1e9:.3f} ns/param" + (
            f" (planned {planned * 1e9:.3f})" if planned else "")
        return f"{self._plan_note}; host optimizer ms/step: {phases}{rate}"

    def finish(self) -> None:
        """Wait for the host optimizer's pending updates."""
        self.engine.optimizer.wait_all()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self._steps += 1
        if self._optimizer_alone:
            optimizer = self.engine.optimizer
            with phase("optimizer"):
                for i, shadow in enumerate(self.engine.shadow.shadows):
                    if shadow.home == "host":
                        optimizer.submit(i, _landed)
                optimizer.finish_step()
                optimizer.wait_all()
            return None
        return engine_step(self.engine, inputs, targets)

    def close(self) -> None:
        self.engine.close()


def _landed() -> None:
    """A gradient that is already in host memory (the host optimizer measured alone)."""


def make(ctx: SystemContext) -> MemFerrySystem:
    """Factory registered as ``memferry``."""
    return MemFerrySystem(ctx)
