"""MPress: pipeline-parallel training whose stages swap saved activations to spare memory of
peer devices (D2D swap), to the host, or recompute them, chosen per block by a planner.

Modules, in the order a job uses them:
    job: :class:`PipelineJob`, one training run, and its unpipelined reference.
    stages: split a :class:`strategies.models.CausalLM` into pipeline stages (embeddings on the
        first, head and loss on the last).
    build: set-up step 1, one rank's stage built on its device.
    profiling: step 2, one measured iteration per stage, every stage's profile gathered.
    memory_profile: what a profile holds (:class:`StageProfile`), as text and JSON.
    planner: step 3's decision per block under every device's budget (:func:`plan_offload`).
    runtime: step 4, a stage running a plan (:class:`StageRuntime`: peer pools, executor).
    stage_setup: the steps in order, and step 5, measuring the plan and re-planning.
    executor: saved-tensor hooks that keep, recompute, host-swap or peer-swap each block's
        saved activations (and profile them).
    ipc: device buffers one process allocates and others write one-sidedly (peer pools).
    pipeline: the multi-process runner of jobs on ``torch.distributed.pipelining`` (GPipe, 1F1B).
    config: the ``xpu mpress`` config: format, options (``devices`` among them) and checks.
    launcher: ``xpu mpress CONFIG.yaml``: the torchrun command, and the training loop each
        torchrun rank runs.

docs/design.md §2 describes the mechanism.
"""
from .executor import Decision, StageExecutor, SwapStats, TensorRecord
from .memory_profile import BlockProfile, StageProfile, dump_profiles, format_profile, load_profiles
from .planner import InfeasibleBudgetError, Plan, PlanOverBudgetError, format_plan, plan_offload
from .stages import StageModule, split_model, partition_blocks

__all__ = [
    "Decision", "StageExecutor", "SwapStats", "InfeasibleBudgetError", "PlanOverBudgetError", "Plan", "StageProfile",
    "BlockProfile", "plan_offload", "format_plan", "format_profile", "dump_profiles", "load_profiles", "TensorRecord", "StageModule",
    "split_model", "partition_blocks",
]
