"""``xpu mpress CONFIG.yaml``: MPress pipeline training from a YAML config, one process per stage under torchrun.

    xpu mpress examples/mpress/tiny.yaml                       # re-runs itself under torchrun, 2 stages
    xpu mpress examples/mpress/tiny.yaml --stages 4 --microbatches 8 --schedule gpipe --budget-gb 0.002
    xpu mpress examples/mpress/tiny.yaml --dry-run             # check the config, print the torchrun command
    xpu mpress examples/mpress/tiny.yaml --profile-json prof.json   # also dump every saved tensor of the profiled step
    torchrun --standalone --nproc_per_node 2 -m xpu mpress examples/mpress/tiny.yaml   # the same, by hand

The config is an ``xpu train`` config (:mod:`strategies.training`) whose strategy is ``mpress``::

    model: {family: gpt, layers: 4, hidden: 64, heads: 4, vocab: 256}   # gpt | llama (hf cannot be split)
    strategy:
      name: mpress
      options: {stages: 2, microbatches: 4, schedule: 1f1b, plan: auto, counts: null, profile: auto}
    device_budget: 64MB     # per stage: the most memory each stage's device may use (null: all of it)
    optimizer: {lr: 1.0e-3, schedule: cosine, warmup_steps: 2, min_lr: 1.0e-4}
    steps: 20
    batch: 8                # split into `microbatches` equal micro-batches
    seq: 64
    data: {kind: synthetic, branching: 4}

Options: ``stages`` (pipeline depth: one process and one device per stage), ``microbatches``
(must divide ``batch``; 1F1B needs at least ``stages``), ``schedule`` (``1f1b`` | ``gpipe``),
``plan`` (``auto``: profile one step, then the planner picks keep / recompute / host swap /
peer swap per block under ``device_budget``; ``recompute``: the same planner allowed only
recomputation (the recompute-only baseline); ``keep``: no offload; or a forced
``{stage: {block: decision}}`` such as ``{0: {0: host, 1: recompute}, 1: {2: "peer:0"}}``),
``counts`` (blocks per stage; null: an even split) and ``profile`` (how the profiled step
treats activations: ``auto`` | ``keep`` | ``host``, see
:data:`~strategies.mpress.job.PROFILE_MODES`). ``checkpoint`` and ``resume`` are not
supported yet.

Each rank builds the whole model from ``seed`` on the host, keeps its own stage on device
``rank`` with an AdamW over its parameters, and draws the same batches as ``xpu train`` would
(the first stage feeds the inputs, the last the targets), so the run's losses equal those of
the unpipelined ``torch`` strategy on the same config (:func:`reference_losses`) up to
summation order. Rank 0 prints the plan and, every ``log_every`` steps, the loss (the mean
over micro-batches, sent from the last stage) and each stage's device peak.

When a step is profiled (``plan: auto``, or ``--profile-json``), rank 0 also prints a line per
stage: its measured peak, budget and spare memory, and its saved tensors in short (count,
bytes, the top producing ops by bytes, median lifetime). ``--profile-json PATH`` profiles a
step whatever the plan and writes every stage's profile with all its tensor records
(:func:`~strategies.mpress.memory_profile.dump_profiles`; read back with
:func:`~strategies.mpress.memory_profile.load_profiles`), even when no plan fits the budget.
"""
from __future__ import annotations

import copy
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from strategies.training import TrainConfig, TrainConfigError
from xpu.dist import collective_timeout

__all__ = ["MPressConfig", "MPressConfigError", "OPTIONS", "load_config", "under_torchrun", "launch_command",
           "check_devices", "run_rank", "reference_losses"]

#: ``strategy.options`` of an mpress config and their defaults.
OPTIONS: dict[str, Any] = {"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "auto", "counts": None,
                           "profile": "auto"}
#: Train-config keys ``xpu mpress`` does not support (yet).
_UNSUPPORTED = ("checkpoint", "resume", "logging")
#: Train-config knobs the pipeline would ignore: (the value that changes nothing, why it is refused).
_REFUSED = {"accumulation_steps": (1, "is not an xpu mpress key: the pipeline splits each batch into "
                                      "strategy.options.microbatches (--microbatches) micro-batches; set that instead"),
            "eval_every": (0, "is not supported by xpu mpress (no held-out evaluation in the pipeline); "
                              "remove it (xpu train supports it)")}
#: Model families that can be split into stages (:mod:`strategies.mpress.stages`).
_SPLITTABLE = ("gpt", "llama")


class MPressConfigError(TrainConfigError):
    """An mpress config that cannot run as written; the message names the key and what would work."""


@dataclass
class MPressConfig:
    """A validated ``xpu mpress`` config.

    Attributes:
        train: the train-config part (model, optimizer, data, steps, batch, seq, dtype, seed,
            log_every, device_budget: the budget of each stage's device), validated by
            :class:`~strategies.training.TrainConfig`.
        stages, microbatches, schedule, plan, counts, profile: the pipeline options (:data:`OPTIONS`).
        source: the YAML file it came from, if any.
    """

    train: TrainConfig
    stages: int
    microbatches: int
    schedule: str
    plan: Any
    counts: tuple[int, ...] | None
    profile: str
    source: str | None = None

    @property
    def budget(self) -> int | None:
        """Each stage's device budget in bytes (None: the whole device)."""
        return self.train.device_budget  # bytes: TrainConfig.validate parsed it

    def job(self, dtype: Any = None) -> Any:
        """The :class:`~strategies.mpress.job.PipelineJob` every rank builds its stage from.

        Its ``steps``, ``lr`` and data are not used: :func:`run_rank` drives the steps itself
        with AdamW and the config's data.
        """
        from .job import PipelineJob

        budget = self.budget
        return PipelineJob(dims=self.train.model_dims(), family=self.train.family, schedule=self.schedule,
                           microbatches=self.microbatches, batch=self.train.batch, steps=self.train.steps,
                           seed=self.train.seed, counts=self.counts, plan=self.plan,
                           budgets={r: budget for r in range(self.stages)} if budget else None, dtype=dtype,
                           profile_mode=self.profile)


# ---------------------------------------------------------------------------------- config
def load_config(source: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> MPressConfig:
    """Load an mpress config from a YAML path or a dict, apply dotted ``overrides``, validate it all.

    ``overrides`` maps dotted keys to values (``{"strategy.options.stages": 4, "steps": 2}``),
    as ``--set`` and the launcher's flags give them.

    Raises:
        MPressConfigError: a missing file, bad YAML, or any invalid key or value.
    """
    from strategies.training.checks import apply_overrides, read_config_source

    data, path = read_config_source(source, MPressConfigError)
    name, base_dir, shown = (path.stem, path.resolve().parent, str(path)) if path is not None else (None, None, None)
    if not isinstance(data, dict):
        raise MPressConfigError(f"an mpress config must be a mapping of keys to values, got {type(data).__name__}")
    data.setdefault("strategy", {"name": "mpress"})
    apply_overrides(data, overrides, MPressConfigError, promote={"strategy": "name"})
    options = _strategy_options(data.pop("strategy"))
    for key in _UNSUPPORTED:
        if data.get(key) is not None:
            raise MPressConfigError(f"'{key}' is not supported by xpu mpress yet; remove it (xpu train supports it)")
        data.pop(key, None)
    for key, (inert, why) in _REFUSED.items():
        if data.get(key, inert) != inert:
            raise MPressConfigError(f"'{key}' {why}")
    model = data.get("model")
    if isinstance(model, dict) and model.get("family") in ("hf",):  # before its dimensions are checked for nothing
        raise MPressConfigError(f"model.family {model['family']!r} cannot be split into pipeline stages; "
                                f"use one of {', '.join(_SPLITTABLE)}")
    # Everything but the pipeline is a train config: the same keys, checks and messages as `xpu train`.
    data["strategy"] = "torch"
    try:
        train = TrainConfig.from_dict(data, name=name, base_dir=base_dir)
    except TrainConfigError as exc:
        message = str(exc)
        if "valid keys:" in message:  # list what mpress accepts, not the train config's full set
            valid = [k for k in message.split("valid keys: ", 1)[1].split(", ") if k not in _UNSUPPORTED and k not in _REFUSED]
            message = message.split("valid keys: ", 1)[0] + "valid keys: " + ", ".join(valid)
        raise MPressConfigError(message) from None
    config = MPressConfig(train=train, source=shown, **options)
    _check_pipeline(config)
    return config


def _strategy_options(value: Any) -> dict[str, Any]:
    """The ``strategy`` section: must be ``mpress``; options checked for names and merged with defaults."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise MPressConfigError(f"strategy is 'mpress' or {{name: mpress, options: {{...}}}}; got {value!r}")
    unknown = set(value) - {"name", "options"}
    if unknown:
        raise MPressConfigError(f"unknown strategy key(s) {sorted(unknown)}; valid: name, options")
    if value.get("name", "mpress") != "mpress":
        raise MPressConfigError(f"strategy.name is {value['name']!r}, but xpu mpress runs only 'mpress' "
                                f"(use `xpu train` for memferry or torch)")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise MPressConfigError(f"strategy.options must be a mapping, got {options!r}")
    bad = set(options) - set(OPTIONS)
    if bad:
        raise MPressConfigError(f"strategy 'mpress' has no option(s) {sorted(bad)}; valid options: "
                                f"{', '.join(sorted(OPTIONS))}")
    return {**copy.deepcopy(OPTIONS), **options}


def _positive(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MPressConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _check_pipeline(c: MPressConfig) -> None:
    """Every pipeline check that needs no device (the rest is :func:`check_devices`)."""
    from .executor import Decision
    from .job import PROFILE_MODES, SCHEDULES
    from .stages import partition_blocks

    t = c.train
    if t.family not in _SPLITTABLE:
        raise MPressConfigError(f"model.family {t.family!r} cannot be split into pipeline stages; "
                                f"use one of {', '.join(_SPLITTABLE)}")
    layers = int(t.model["layers"])
    _positive("strategy.options.stages (--stages)", c.stages)
    if c.stages > layers:
        raise MPressConfigError(f"strategy.options.stages (--stages) is {c.stages} but model.layers is {layers}: "
                                f"each stage needs at least one block; use at most {layers} stages or raise model.layers")
    _positive("strategy.options.microbatches (--microbatches)", c.microbatches)
    if t.batch % c.microbatches:
        divisors = [d for d in range(1, t.batch + 1) if t.batch % d == 0]
        raise MPressConfigError(f"strategy.options.microbatches (--microbatches) is {c.microbatches}, which does not "
                                f"divide batch {t.batch} into equal micro-batches; use one of "
                                f"{', '.join(map(str, divisors))}")
    if c.schedule not in SCHEDULES:
        raise MPressConfigError(f"strategy.options.schedule (--schedule) is {c.schedule!r}; valid: {', '.join(SCHEDULES)}")
    if c.schedule == "1f1b" and c.microbatches < c.stages:
        raise MPressConfigError(f"schedule 1f1b needs at least as many micro-batches as stages: microbatches is "
                                f"{c.microbatches}, stages {c.stages}; use --microbatches {c.stages} or more "
                                f"(dividing batch {t.batch}), or --schedule gpipe")
    if c.profile not in PROFILE_MODES:
        raise MPressConfigError(f"strategy.options.profile is {c.profile!r}; valid: {', '.join(PROFILE_MODES)}")
    if c.counts is not None:
        if not isinstance(c.counts, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                              for n in c.counts):
            raise MPressConfigError(f"strategy.options.counts must be a list of blocks per stage or null, got {c.counts!r}")
        c.counts = tuple(c.counts)
    try:
        parts = partition_blocks(layers, c.stages, list(c.counts) if c.counts is not None else None)
    except ValueError as exc:
        raise MPressConfigError(f"strategy.options.counts: {exc}") from None
    if isinstance(c.plan, dict):
        plan: dict[int, dict[int, str]] = {}
        for stage, blocks in c.plan.items():
            if not isinstance(stage, int) or not 0 <= stage < c.stages:
                raise MPressConfigError(f"strategy.options.plan: stage {stage!r} is not one of 0..{c.stages - 1}")
            if not isinstance(blocks, dict):
                raise MPressConfigError(f"strategy.options.plan: stage {stage} needs a mapping {{block: decision}}, "
                                        f"got {blocks!r}")
            plan[stage] = {}
            for block, decision in blocks.items():
                if block not in parts[stage]:
                    raise MPressConfigError(f"strategy.options.plan: block {block!r} is not on stage {stage}, which "
                                            f"runs blocks {parts[stage].start}..{parts[stage].stop - 1}")
                try:
                    parsed = Decision.parse(decision)
                except (ValueError, TypeError) as exc:
                    raise MPressConfigError(f"strategy.options.plan: stage {stage} block {block}: {exc}") from None
                if parsed.kind == "peer" and not (0 <= parsed.peer < c.stages and parsed.peer != stage):
                    raise MPressConfigError(f"strategy.options.plan: stage {stage} block {block}: peer {parsed.peer} "
                                            f"must be another stage's device (0..{c.stages - 1}, not {stage})")
                plan[stage][block] = str(parsed)
        c.plan = plan
    elif c.plan not in ("auto", "recompute", "keep"):
        raise MPressConfigError(f"strategy.options.plan is {c.plan!r}; valid: auto, recompute, keep, or "
                                f"{{stage: {{block: keep|recompute|host|peer:<stage>}}}}")
    try:  # the runtime's own checks, as a net under the ones above
        c.job().validate(c.stages)
    except ValueError as exc:
        raise MPressConfigError(str(exc)) from None


def check_devices(config: MPressConfig, backend: Any, *, add_virtual: bool = False) -> dict[str, str]:
    """Check the config against ``backend``'s devices; return environment the stage processes need.

    With ``add_virtual`` (the launcher, before it starts the ranks), the cpu backend's stages
    get as many virtual devices of the same capacity as they need (``XPU_CPU_DEVICES``);
    otherwise there must be a device per stage.

    Raises:
        MPressConfigError: too few devices, or a budget larger than a stage's device.
    """
    from xpu.units import format_bytes

    env: dict[str, str] = {}
    devices = list(backend.topology().devices)
    # A comma list of capacities names each device: more of them cannot be made up.
    made_up = backend.env_for_device_count(config.stages) if add_virtual and len(devices) < config.stages else None
    if made_up:
        env.update(made_up)
        devices += [devices[0]] * (config.stages - len(devices))
    if len(devices) < config.stages:
        raise MPressConfigError(f"{config.stages} stages need {config.stages} devices, one each; backend "
                                f"'{backend.name}' has {len(devices)}: lower --stages or make more devices visible")
    budget = config.budget
    if budget is not None:
        for index, d in enumerate(devices[:config.stages]):
            if budget > d.total_bytes:
                raise MPressConfigError(f"device_budget (--budget-gb) {format_bytes(budget)} exceeds device {index}'s "
                                        f"{format_bytes(d.total_bytes)}; lower it, or set it to null for the whole device")
    return env


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
        InfeasibleBudgetError: no plan fits the budget (raised on every rank).
        torch.OutOfMemoryError: a stage ran out of device memory.
    """
    import torch
    import torch.distributed as dist

    import xpu
    from strategies.training import lr_at, make_data, resolve_dtype  # the same dtype choice and batches as `xpu train`
    from xpu.units import format_bytes

    from .build import adamw_with_states, build_stage
    from .memory_profile import dump_profiles, format_profile
    from .planner import format_plan
    from .profiling import profile_stages
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
    backend.bind_process(rank)
    dist.init_process_group(backend.dist_backend, rank=rank, world_size=world, timeout=timeout)
    try:
        box: list[torch.optim.Optimizer] = []
        job = config.job(dtype)
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
            f"{backend.name} backend, {dtype_name}, budget {format_bytes(budget) + ' per stage' if budget else 'whole device'}")
        data, data_desc = make_data(t)  # every rank draws the same batches; stage 0 uses inputs, the last targets
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
        runtime.apply_cap()
        losses: list[float] = []
        times: list[float] = []
        peaks: list[int] = [0] * world
        t_begin = time.perf_counter()
        for i in range(t.steps):
            lr = lr_at(o, i, t.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = data.next()
            t0 = time.perf_counter()
            with backend.device_scope(rank):
                idx = backend.to_device(inputs, rank) if stage.is_first else None
                tgt = backend.to_device(targets, rank) if stage.is_last else None
                stage.zero_grad(set_to_none=True)
                mb_losses = runtime.step(idx, tgt)
                optimizer.step()
                loss = float(torch.stack([l.float() for l in mb_losses]).mean()) if mb_losses else None
                del idx, tgt, mb_losses
                backend.synchronize(rank)
            step_s = time.perf_counter() - t0
            # The loss lives on the last stage: one small gather brings it, and every stage's peak, to rank 0.
            reports: list[Any] = [None] * world
            dist.all_gather_object(reports, (loss, backend.memory_stats(rank).peak_allocated))
            losses.append(reports[-1][0])
            peaks = [r[1] for r in reports]
            times.append(step_s)
            n = i + 1
            if n % t.log_every == 0 or n == 1 or n == t.steps:
                say(f"step {n:>6d}/{t.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  {step_s * 1e3:7.1f} ms/step  "
                    f"peak {' | '.join(format_bytes(p) for p in peaks)}")
        wall = time.perf_counter() - t_begin
        summary = {"name": t.name, "stages": world, "schedule": config.schedule, "microbatches": config.microbatches,
                   "losses": losses, "step_times_s": times, "wall_s": wall, "peaks": peaks,
                   "budget": budget, "plan": plan_text, "profile_modes": [f[1] for f in facts],
                   "decisions": {str(s): f[2] for s, f in enumerate(facts) if f[2]}}
        k = max(1, min(10, len(losses) // 10))
        head, tail = losses[:k], losses[-k:]
        say(f"done: {len(losses)} steps in {wall:.1f} s; loss {sum(head) / k:.3f} -> {sum(tail) / k:.3f} "
            f"(mean of first/last {k}); peak device memory per stage {' | '.join(format_bytes(p) for p in peaks)}")
        # Only on success: after a failure the peers may never reach this barrier (torchrun stops them).
        runtime.close()
        if json_out and rank == 0:
            print(json.dumps(summary), flush=True)
        return summary if rank == 0 else None
    finally:
        backend.set_memory_cap(rank, None)
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
