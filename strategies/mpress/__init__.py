"""MPress: pipeline-parallel training whose stages swap saved activations to spare memory of
peer devices (D2D swap), to the host, or recompute them, chosen per block by a planner.

Modules:
    stages: split a :class:`strategies.models.CausalLM` into pipeline stages (embeddings on the
        first, head and loss on the last).
    executor: saved-tensor hooks that keep, recompute, host-swap or peer-swap each block's
        saved activations (and profile them).
    ipc: device buffers one process allocates and others write one-sidedly (peer pools).
    planner: the per-block decision under every device's budget.
    pipeline: the multi-process runtime on ``torch.distributed.pipelining`` (GPipe, 1F1B)
        and its launcher.
    launcher: ``xpu mpress CONFIG.yaml``: config checks, the torchrun command, and the
        training loop each torchrun rank runs.

DESIGN.md §2 describes the mechanism.
"""
from .executor import Decision, StageExecutor, SwapStats, TensorRecord
from .planner import (InfeasibleBudgetError, Plan, StageProfile, BlockProfile, plan_offload, format_plan, format_profile,
                      dump_profiles, load_profiles)
from .stages import StageModule, split_model, partition_blocks

__all__ = [
    "Decision", "StageExecutor", "SwapStats", "InfeasibleBudgetError", "Plan", "StageProfile", "BlockProfile",
    "plan_offload", "format_plan", "format_profile", "dump_profiles", "load_profiles", "TensorRecord", "StageModule",
    "split_model", "partition_blocks",
]
