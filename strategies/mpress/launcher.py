"""``xpu mpress CONFIG.yaml``: MPress pipeline training from a YAML config, one process per stage under torchrun.

    xpu mpress examples/mpress/tiny.yaml                       # re-runs itself under torchrun, 2 stages
    xpu mpress examples/mpress/tiny.yaml --stages 4 --microbatches 8 --schedule gpipe --budget-gb 0.002
    xpu mpress examples/mpress/tiny.yaml --dry-run             # check the config, print the torchrun command
    xpu mpress examples/mpress/tiny.yaml --profile-json prof.json   # also dump every saved tensor of the profiled step
    torchrun --standalone --nproc_per_node 2 -m xpu mpress examples/mpress/tiny.yaml   # the same, by hand

The config (:mod:`strategies.mpress.config`: format, options and checks) is an ``xpu train``
config whose strategy is ``mpress``.

Each rank builds the whole model from ``seed`` on the host, keeps its own stage on its device
(``devices[rank]``, by default ``rank``) with an AdamW over its parameters, and draws the same
batches as ``xpu train`` would (the first stage feeds the inputs, the last the targets), so the
run's losses equal those of the unpipelined ``torch`` strategy on the same config
(:func:`reference_losses`) up to summation order. Rank 0 prints the plan and, every
``log_every`` steps, the loss (the mean over micro-batches, sent from the last stage) and each
stage's device peak (and each shared device's, its stages added).

When a step is profiled (``plan: auto``, or ``--profile-json``), rank 0 also prints a line per
stage: its measured peak, budget and spare memory, and its saved tensors in short (count,
bytes, the top producing ops by bytes, median lifetime). ``--profile-json PATH`` profiles a
step whatever the plan and writes every stage's profile with all its tensor records
(:func:`~strategies.mpress.memory_profile.dump_profiles`; read back with
:func:`~strategies.mpress.memory_profile.load_profiles`), even when no plan fits the budget.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import replace
from typing import Any, Callable

from strategies.training import TrainConfig
from xpu.dist import collective_timeout, p2p_library

# The config half lives in .config; re-exported here, where callers have always found it.
from .config import OPTIONS, MPressConfig, MPressConfigError, check_devices, load_config

__all__ = ["MPressConfig", "MPressConfigError", "OPTIONS", "load_config", "under_torchrun", "launch_command",
           "check_devices", "run_rank", "reference_losses"]


# ---------------------------------------------------------------------------------- launching
def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank started by torchrun (``LOCAL_RANK`` and ``WORLD_SIZE`` set)."""
    env = os.environ if environ is None else environ
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def launch_command(config_path: str, stages: int, rank_args: list[str]) -> list[str]:
    """The command that starts ``stages`` ranks of ``xpu mpress config_path rank_args`` through torchrun's module.

    ``--standalone`` runs a rendezvous on this host at a free port; each rank re-enters
    ``python -m xpu mpress``, sees torchrun's environment and runs its stage.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages),
            "-m", "xpu", "mpress", config_path, "--stages", str(stages), *rank_args]


def format_command(command: list[str], env: dict[str, str]) -> str:
    """``command`` as one shell line, prefixed by the environment it adds."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + shlex.join(command)


# ---------------------------------------------------------------------------------- one rank
def run_rank(config: MPressConfig, *, log: Callable[[str], None] | None = None, json_out: bool = False,
             backend: Any = None, profile_json: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Train ``config`` as this torchrun rank's stage; rank 0 returns the run's summary, others None.

    Joins the process group from torchrun's environment (the backend's collective library:
    gloo on the cpu backend), builds, profiles and plans the stage
    (:mod:`strategies.mpress.stage_setup`, with AdamW states allocated first so the plan
    counts them), applies the budget as the device's memory cap and trains
    ``steps`` steps. Rank 0 logs through ``log`` (default: print to stdout, or stderr with
    ``json_out``) and, with ``json_out``, prints the summary as one JSON line on stdout.
    With ``profile_json``, a step is profiled whatever the plan and rank 0 writes every
    stage's profile there (:func:`~strategies.mpress.memory_profile.dump_profiles`).

    Raises:
        MPressConfigError: the world size does not match the stages, or the devices do not fit.
        InfeasibleBudgetError: no plan fits the budget, or (:class:`~strategies.mpress.planner.PlanOverBudgetError`)
            the config's own plan does not (raised on every rank).
        torch.OutOfMemoryError: a stage ran out of device memory.
    """
    import torch
    import torch.distributed as dist

    import xpu
    from strategies.training import lr_at, make_data, resolve_dtype  # the same dtype choice and batches as `xpu train`
    from strategies.training.checkpoints import VERIFIED_ENV, new_run_id, prepare_checkpoint_dir
    from strategies.training.reports import StepReport
    from xpu.units import format_bytes

    from .build import adamw_with_states, build_stage
    from .checkpointing import check_resume, load_stage_state, save_merged, stage_state
    from .memory_profile import dump_profiles, format_profile
    from .planner import format_plan
    from .profiling import profile_stages
    from .step_log import PipelineLog
    from .stage_setup import plan_and_run

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.stages:
        raise MPressConfigError(f"torchrun started {world} processes but the pipeline has {config.stages} stages; "
                                f"start one per stage (--nproc_per_node {config.stages}) or pass --stages {world}")
    backend = backend or xpu.get_backend()
    check_devices(config, backend)
    stream = sys.stderr if json_out else sys.stdout  # with --json, stdout carries the summary alone
    emit = log or (lambda line: print(line, file=stream, flush=True))
    say = emit if rank == 0 else (lambda line: None)
    t = config.train
    dtype_name, dtype = resolve_dtype(t, backend)
    o = t.optimizer
    adamw = {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}
    # A bounded timeout: a stage that dies must not leave its peers waiting forever.
    timeout = collective_timeout(300.0)
    # This stage's device current for good: NCCL stages collective objects on the current device.
    job = config.job(dtype)
    device = job.device_of(rank)
    backend.bind_process(device)
    # Stages sharing a device meet over the host library (an accelerator's refuses two ranks on one device).
    library = p2p_library(backend.dist_backend, [job.device_of(s) for s in range(world)])
    dist.init_process_group(library, rank=rank, world_size=world, timeout=timeout)
    log = PipelineLog(t)  # `logging:`'s writers, on rank 0
    summary: dict[str, Any] | None = None
    try:
        ckpt = t.checkpoint
        # Checkpoints gather host copies: over the host library, whatever the stages send each other.
        objects = dist.new_group(backend="gloo") if ckpt is not None and library != "gloo" else None
        # Checked by `xpu mpress` before launch too: its mark spares each stage the checksum pass.
        resumed = check_resume(t, config.options(), dtype_name, os.environ.get(VERIFIED_ENV)) if t.resume else None
        run_id = resumed[1]["run_id"] if resumed else new_run_id()  # rank 0's is the one written
        box: list[torch.optim.Optimizer] = []
        if profile_json is not None:
            job = replace(job, profile=True)
        built = build_stage(job, rank, world, backend, prepare=lambda stage: box.append(adamw_with_states(stage, adamw)))
        profiled = profile_stages(built)
        if profile_json is not None and rank == 0:
            # Before planning: on a refusal the profile is what says why no plan fits.
            dump_profiles(profiled.stages, profile_json, name=t.name, stages=world, schedule=config.schedule,
                          microbatches=config.microbatches, backend=backend.name)
        runtime = plan_and_run(built, profiled)  # raises InfeasibleBudgetError on every rank when no plan fits
        stage, optimizer = runtime.stage, box[0]
        # (parameters, how it was profiled, its decisions) of every stage, for rank 0's report.
        facts: list[Any] = [None] * world
        profile = runtime.profile
        dist.all_gather_object(facts, (sum(p.numel() for p in stage.parameters()), profile.mode if profile else None,
                                       {str(b): str(d) for b, d in runtime.decisions.items()}))
        budget = config.budget
        say(f"xpu mpress {t.name}: {sum(f[0] for f in facts) / 1e6:.2f}M parameters, {world} stages "
            f"({config.schedule}, {config.microbatches} micro-batches of {t.batch // config.microbatches}), "
            f"{backend.name} backend, {dtype_name}, budget {format_bytes(budget) + ' per device' if budget else 'whole device'}"
            + (f", stages on devices {list(config.devices)}" if config.devices is not None else ""))
        # Every rank draws the same batches (stage 0 uses inputs, the last targets), all seq wide:
        # the stages exchange activations of one shape.
        data, data_desc = make_data(t, fixed_width=True)
        say(f"data: {data_desc}; {t.batch * t.seq:,} tokens per step")
        if profile is not None:
            say("profiled: " + ", ".join(f"stage {s} {f[1]}" for s, f in enumerate(facts)))
            for p in runtime.profiles:
                say("  " + format_profile(p))
            if profile_json is not None:
                say(f"profile: every stage's saved tensors written to {profile_json}")
        # The plan alone: the profile lines are above.
        plan_text = format_plan(runtime.plan) if runtime.plan is not None else ""
        if isinstance(config.plan, dict):  # a given plan predicts nothing: its decisions are the whole story
            plan_text = "\n".join(f"stage {s}: " + ", ".join(f"block {b}: {d}" for b, d in sorted(blocks.items()))
                                  for s, blocks in sorted(config.plan.items()) if blocks)
            say(f"plan (given; unlisted blocks kept):\n{plan_text}")
        elif config.plan in ("auto", "recompute"):
            say(f"plan (chosen by the planner):\n{plan_text}")
        start, resumed_from = 0, None
        if resumed is not None:  # after planning: the profiled steps ran on the initial weights, as planned
            path, state, notices, _ = resumed
            with backend.device_scope(device):
                load_stage_state(stage, optimizer, state["engine"], path)
            data.load_state_dict(state["data"])
            start, resumed_from = int(state["step"]), str(path)
            say(f"resumed from {path} (step {start})")
            for notice in notices:
                say(notice)
            del state, resumed
        if ckpt is not None and rank == 0:
            prepare_checkpoint_dir(t, run_id)
        runtime.apply_cap()
        saved: list[str] = []
        losses: list[float] = []
        times: list[float] = []
        peaks: list[int] = [0] * world
        log.start(name=t.name, backend=backend.name, device=device, dtype=dtype_name, params=sum(f[0] for f in facts),
                  strategy="mpress", options=config.options(), device_budget=budget, data=data_desc, start_step=start,
                  steps=t.steps, tokens_per_step=t.batch * t.seq, resumed_from=resumed_from, plan=plan_text or None,
                  run_id=run_id)
        t_begin = time.perf_counter()
        for i in range(start, t.steps):
            lr = lr_at(o, i, t.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = data.next()
            t0 = time.perf_counter()
            with backend.device_scope(device):
                idx = backend.to_device(inputs, device) if stage.is_first else None
                tgt = backend.to_device(targets, device) if stage.is_last else None
                stage.zero_grad(set_to_none=True)
                mb_losses = runtime.step(idx, tgt)
                optimizer.step()
                loss = float(torch.stack([l.float() for l in mb_losses]).mean()) if mb_losses else None
                del idx, tgt, mb_losses
                backend.synchronize(device)
            step_s = time.perf_counter() - t0
            # The loss lives on the last stage: one small gather brings it, and every stage's peak, to rank 0.
            reports: list[Any] = [None] * world
            dist.all_gather_object(reports, (loss, backend.memory_stats(device).peak_allocated))
            losses.append(reports[-1][0])
            peaks = [r[1] for r in reports]
            times.append(step_s)
            n = i + 1
            note = ""
            if ckpt is not None and ((ckpt.every and n % ckpt.every == 0) or n == t.steps):
                parts: list[Any] | None = [None] * world if rank == 0 else None
                dist.gather_object(stage_state(stage, optimizer), parts, dst=0, group=objects)
                if rank == 0:
                    saved.append(str(save_merged(t, config.options(), n, parts, data, run_id, dtype_name)))
                    note = f"  saved {saved[-1]}"
            shown = n % t.log_every == 0 or n == start + 1 or n == t.steps or bool(note)
            log.step(StepReport(n, t.steps, losses[-1], lr, step_s, max(peaks), shown, saved[-1] if note else None))
            if shown:
                say(f"step {n:>6d}/{t.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  {step_s * 1e3:7.1f} ms/step  "
                    f"peak {' | '.join(format_bytes(p) for p in peaks)}{note}")
        wall = time.perf_counter() - t_begin
        summary = {"name": t.name, "stages": world, "schedule": config.schedule, "microbatches": config.microbatches,
                   "losses": losses, "step_times_s": times, "wall_s": wall, "peaks": peaks,
                   "devices": [job.device_of(s) for s in range(world)], "device_peaks": built.device_loads(peaks),
                   "budget": budget, "plan": plan_text, "profile_modes": [f[1] for f in facts],
                   "decisions": {str(s): f[2] for s, f in enumerate(facts) if f[2]}, "start_step": start,
                   "checkpoints": saved}
        k = max(1, min(10, len(losses) // 10))
        head, tail = losses[:k], losses[-k:]
        say(f"done: {len(losses)} steps in {wall:.1f} s; loss {sum(head) / k:.3f} -> {sum(tail) / k:.3f} "
            f"(mean of first/last {k}); peak device memory per stage {' | '.join(format_bytes(p) for p in peaks)}"
            + ("".join(f"; device {d}: {format_bytes(b)} (its stages added)" for d, b in
                       sorted(summary["device_peaks"].items())) if job.shares_devices(world) else ""))
        # Only on success: after a failure the peers may never reach this barrier (torchrun stops them).
        runtime.close()
        if json_out and rank == 0:
            print(json.dumps(summary), flush=True)
        return summary if rank == 0 else None
    finally:
        log.end(summary)  # None after a failure: the writers close what they wrote
        backend.set_memory_cap(device, None)
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------- reference
def reference_losses(config: MPressConfig, backend: Any = None) -> list[float]:
    """The losses of the same run unpipelined: ``xpu train``'s ``torch`` strategy on the same config, in this process.

    Same model (built from ``seed``), batches, AdamW and learning-rate schedule; no budget
    (the reference is the arithmetic, not the memory plan).
    """
    from strategies.training import train

    data = config.train.to_dict()
    data.update(strategy={"name": "torch", "options": {}}, device_budget=None)
    reference = TrainConfig.from_dict(data, base_dir=config.train.base_dir)
    return list(train(reference, backend=backend).losses)
