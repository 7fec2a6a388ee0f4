"""DeepSpeed baselines, configured exactly as docs/design.md §3 describes.

* ``deepspeed-z2-offload``: ZeRO-2, optimizer offloaded to CPU (anchor 0.865 s, 17.7 GB);
* ``deepspeed-z3-offload``: ZeRO-3, parameters and optimizer offloaded, model built under
  ``deepspeed.zero.Init`` (anchor 0.950 s, 17.9 GB);
* ``deepspeed-twinflow``: ZeRO-3 with ``offload_optimizer.ratio`` R and no parameter offload
  (anchor R=0.5: 0.714 s, R=0.2: 0.622 s, 33.5 GB);
* ``deepspeed-zenflow``: the ZeRO-2 offload config plus a ``zenflow`` block (anchor: median
  0.219 s, every 4th step 0.9 s, mean 0.35 s, 18.2 GB; approximate: stale updates).

The JSON below is docs/design.md §3's, plus explicit ``optimizer.params`` equal to DeepSpeed's own
AdamW defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0) taken from the
scenario, so every system trains with the same hyper-parameters and their losses compare.
The scenario's ``accumulation_steps`` N becomes ``gradient_accumulation_steps`` (a step: N
micro-batches, each ``engine.backward(loss)`` and ``engine.step()``, the update on the N-th).
The optimizer gets HF Trainer's parameter groups (no weight decay for biases and norm weights).
The ``config`` option deep-merges further keys into the generated config (for experiments;
rows record the final config). Option ``recompute`` turns activation checkpointing on per block
before ``deepspeed.initialize``, as HF's Trainer orders it (:func:`~bench.systems.base.set_recompute`:
HF models through ``gradient_checkpointing_enable``, non-reentrant; torch's checkpoint per block
of ours). Known limit: ZeRO-3 with non-reentrant checkpointing and *frozen* parameters (LoRA)
fails its recompute check in DeepSpeed releases before the fix of deepspeedai/DeepSpeed#8148;
full fine-tuning is unaffected.

Every system takes option ``ranks`` (default 1: one process). With more, the engine runs
data-parallel in ``ranks`` processes, one device each (:mod:`bench.systems.multirank`): each
rank builds the same model and its engine over the whole world (world size = ``ranks``), with
``train_micro_batch_size_per_gpu`` = its share of the scenario's (global) batch.

Failure modes made explicit: DeepSpeed not installed -> "missing" (decided before a worker
starts, and again before any rank starts); its CPUAdam/FusedAdam just-in-time build failing ->
"error" with the builder's message (the worker log has the compiler output); the launch needs
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, which the worker sets for one process
and each rank sets for itself.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from .base import BenchSystem, SystemContext, engine_step, set_recompute
from .multirank import per_rank

__all__ = ["DeepSpeedSystem", "ds_config", "make_z2", "make_z3", "make_twinflow", "make_zenflow"]

_ZENFLOW_KEYS = ("topk_ratio", "update_interval", "select_strategy", "select_interval", "full_warm_up_rounds", "overlap_step")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def ds_config(kind: str, ctx: SystemContext) -> dict[str, Any]:
    """The DeepSpeed config of ``kind`` (``z2``, ``z3``, ``twinflow``, ``zenflow``) for ``ctx``.

    Raises:
        ValueError: unknown kind, or a dtype DeepSpeed offload cannot run (fp32 is allowed:
            mixed precision off).
    """
    precision = {}
    if ctx.dtype == torch.bfloat16:
        precision = {"bf16": {"enabled": True}}
    elif ctx.dtype == torch.float16:
        precision = {"fp16": {"enabled": True}}
    o = ctx.optimizer
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ctx.batch,
        "gradient_accumulation_steps": ctx.accumulation_steps,
        **precision,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": list(o["betas"]), "eps": o["eps"],
                                                   "weight_decay": o["weight_decay"]}},
        # Quiet: DeepSpeed's per-step prints would land inside timed steps.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    zero = cfg["zero_optimization"]
    if kind == "z2":
        pass
    elif kind == "z3":
        zero["stage"] = 3
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif kind == "twinflow":
        zero["stage"] = 3
        zero["offload_optimizer"] = {"device": "cpu", "ratio": float(ctx.options["ratio"])}
    elif kind == "zenflow":
        zero["zenflow"] = {k: ctx.options[k] for k in _ZENFLOW_KEYS}
    else:
        raise ValueError(f"unknown DeepSpeed config kind {kind!r}; valid: z2, z3, twinflow, zenflow")
    return _merge(cfg, ctx.options.get("config") or {})


def _set_launch_env() -> None:
    # deepspeed.comm.init_distributed falls back to MPI discovery without these. setdefault:
    # a rank of a multi-rank run has set its own (bench.systems.multirank).
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        os.environ.setdefault(key, value)


class DeepSpeedSystem(BenchSystem):
    """A DeepSpeed engine over the scenario's model: ``engine(x, y)``, ``engine.backward``, ``engine.step``."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext, kind: str) -> None:
        _set_launch_env()
        import deepspeed  # ModuleNotFoundError here -> the row says "missing"

        if ctx.backend.caps.virtual_devices:
            # DeepSpeed would pick its own accelerator, not our virtual device; say so plainly.
            raise RuntimeError("DeepSpeed offload baselines need an accelerator; the cpu reference backend has none")
        self.config = ds_config(kind, ctx)
        self.kind = kind
        # A pretrained HF folder is loaded on the host and partitioned by deepspeed.initialize:
        # from_pretrained inside our zero.Init would fill partitioned (empty) parameters without
        # transformers knowing ZeRO-3 is on.
        from_folder = ctx.family == "hf" and ctx.dims.get("path") is not None
        if self.config["zero_optimization"]["stage"] == 3 and not from_folder:
            # docs/design.md §3: stage 3 builds the model under zero.Init (partitioned as it is built).
            with deepspeed.zero.Init(config_dict_or_path=self.config):
                model = ctx.build_model()
        else:
            model = ctx.build_model(device="cpu", dtype=torch.float32)
        model.train()
        recompute = set_recompute(model, ctx.options.get("recompute", False))  # before the engine wraps it
        # Biases and norm weights without weight decay, as every other system (a group's
        # weight_decay overrides the config's optimizer.params).
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=ctx.adamw_params(model),
                                                    config=self.config)
        self._accumulation = ctx.accumulation_steps
        self.notes = f"deepspeed {deepspeed.__version__}, zero stage {self.config['zero_optimization']['stage']}"
        if ctx.accumulation_steps > 1:
            self.notes += f", gradient_accumulation_steps={ctx.accumulation_steps}"
        if from_folder and self.config["zero_optimization"]["stage"] == 3:
            self.notes += ", model loaded on the host, partitioned by deepspeed.initialize"
        if recompute:
            self.notes += f", {recompute}"
        if kind == "twinflow":
            self.notes += f", offload_optimizer.ratio={self.config['zero_optimization']['offload_optimizer']['ratio']}"
        if kind == "zenflow":
            self.notes += ", zenflow " + ", ".join(f"{k}={v}" for k, v in self.config["zero_optimization"]["zenflow"].items())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # DeepSpeed's own accumulation: backward(loss) (it divides by gradient_accumulation_steps)
        # and step() after every micro-batch; it updates on the last one only.
        return engine_step(self.engine, inputs, targets, self._accumulation, step_each=True)

    def close(self) -> None:
        # ZenFlow's overlapped optimizer runs in a child process; ask the optimizer to stop it.
        opt = getattr(self.engine, "optimizer", None)
        proc = getattr(opt, "process", None)
        if proc is not None and hasattr(proc, "terminate"):
            proc.terminate()
        self.engine = None


@per_rank("deepspeed-z2-offload")
def make_z2(ctx: SystemContext) -> BenchSystem:
    """Factory registered as ``deepspeed-z2-offload``."""
    return DeepSpeedSystem(ctx, "z2")


@per_rank("deepspeed-z3-offload")
def make_z3(ctx: SystemContext) -> BenchSystem:
    """Factory registered as ``deepspeed-z3-offload``."""
    return DeepSpeedSystem(ctx, "z3")


def _check_ratio(ctx: SystemContext) -> None:
    """Raise ValueError unless option ``ratio`` is a number in [0, 1]."""
    ratio = ctx.options["ratio"]
    if not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"deepspeed-twinflow: ratio must be a number in [0, 1], got {ratio!r}")


@per_rank("deepspeed-twinflow", check=_check_ratio)
def make_twinflow(ctx: SystemContext) -> BenchSystem:
    """Factory registered as ``deepspeed-twinflow`` (option ``ratio``: share of optimizer states on CPU)."""
    _check_ratio(ctx)
    return DeepSpeedSystem(ctx, "twinflow")


@per_rank("deepspeed-zenflow")
def make_zenflow(ctx: SystemContext) -> BenchSystem:
    """Factory registered as ``deepspeed-zenflow`` (approximate: stale updates by design)."""
    return DeepSpeedSystem(ctx, "zenflow")
