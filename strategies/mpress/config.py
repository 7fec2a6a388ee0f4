"""The ``xpu mpress`` config: its format, its options and every check that needs no running stage.

The config is an ``xpu train`` config (:mod:`strategies.training`) whose strategy is ``mpress``::

    model: {family: gpt, layers: 4, hidden: 64, heads: 4, vocab: 256}   # gpt | llama (hf cannot be split)
    strategy:
      name: mpress
      options: {stages: 2, microbatches: 4, schedule: 1f1b, plan: auto, counts: null, profile: auto, devices: null}
    device_budget: 64MB     # per device: the most memory each stage's device may use (null: all of it)
    optimizer: {lr: 1.0e-3, schedule: cosine, warmup_steps: 2, min_lr: 1.0e-4}
    steps: 20
    batch: 8                # split into `microbatches` equal micro-batches
    seq: 64
    data: {kind: synthetic, branching: 4}

Options: ``stages`` (pipeline depth: one process per stage), ``microbatches``
(must divide ``batch``; 1F1B needs at least ``stages``), ``schedule`` (``1f1b`` | ``gpipe``),
``plan`` (``auto``: profile one step, then the planner picks keep / recompute / host swap /
peer swap per block under ``device_budget``; ``recompute``: the same planner allowed only
recomputation (the recompute-only baseline); ``keep``: no offload; or a forced
``{stage: {block: decision}}`` such as ``{0: {0: host, 1: recompute}, 1: {2: "peer:0"}}``),
``counts`` (blocks per stage; null: an even split), ``profile`` (how the profiled step
treats activations: ``auto`` | ``keep`` | ``host``, see
:data:`~strategies.mpress.job.PROFILE_MODES`) and ``devices`` (the device index of each
stage, e.g. ``[0, 0]``: both stages on device 0; null: stage ``i`` on device ``i``). Stages
on one device share its ``device_budget``: the planner fits their peaks into it together
(:mod:`strategies.mpress.planner`). ``checkpoint`` and ``resume`` work as in ``xpu train``
(one ``step-N.pt`` holding every stage, :mod:`strategies.mpress.checkpointing`); a run may resume
under other pipeline options; ``logging`` writes rank 0's step rows as ``xpu train`` does.

:func:`load_config` reads and checks a config (:class:`MPressConfig`); :func:`check_devices`
checks it against a backend's devices. Every bad value is a :class:`MPressConfigError` naming
the key and what would work.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strategies.training import TrainConfig, TrainConfigError

__all__ = ["MPressConfig", "MPressConfigError", "OPTIONS", "load_config", "check_devices"]

#: ``strategy.options`` of an mpress config and their defaults.
OPTIONS: dict[str, Any] = {"stages": 2, "microbatches": 4, "schedule": "1f1b", "plan": "auto", "counts": None,
                           "profile": "auto", "devices": None}
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
            log_every, device_budget: the budget of each device, shared by the stages on it),
            validated by :class:`~strategies.training.TrainConfig`.
        stages, microbatches, schedule, plan, counts, profile, devices: the pipeline options (:data:`OPTIONS`).
        source: the YAML file it came from, if any.
    """

    train: TrainConfig
    stages: int
    microbatches: int
    schedule: str
    plan: Any
    counts: tuple[int, ...] | None
    profile: str
    devices: tuple[int, ...] | None = None
    source: str | None = None

    def options(self) -> dict[str, Any]:
        """The pipeline options as ``strategy.options`` holds them (what a checkpoint records)."""
        return {key: list(v) if isinstance(v := getattr(self, key), tuple) else v for key in OPTIONS}

    @property
    def budget(self) -> int | None:
        """Each device's budget in bytes, shared by the stages on it (None: the whole device)."""
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
                           profile_mode=self.profile, devices=self.devices)


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
            valid = [k for k in message.split("valid keys: ", 1)[1].split(", ") if k not in _REFUSED]
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
    _check_device_map(c)
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


def _check_device_map(c: MPressConfig) -> None:
    """``strategy.options.devices``: null, or one non-negative device index per stage (made a tuple)."""
    if c.devices is None:
        return
    key, like = "strategy.options.devices", f"e.g. {[0] * c.stages} (every stage on device 0) or {list(range(c.stages))}"
    if not isinstance(c.devices, (list, tuple)):
        raise MPressConfigError(f"{key} must list one device index per stage ({like}), or be null for stage i on "
                                f"device i; got {c.devices!r}")
    if len(c.devices) != c.stages:
        raise MPressConfigError(f"{key} lists {len(c.devices)} device(s) for {c.stages} stages; give one device index "
                                f"per stage, {like}")
    for s, d in enumerate(c.devices):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise MPressConfigError(f"{key}[{s}] is {d!r}; device indices are whole numbers from 0, {like}")
    c.devices = tuple(c.devices)


def check_devices(config: MPressConfig, backend: Any, *, add_virtual: bool = False) -> dict[str, str]:
    """Check the config against ``backend``'s devices; return environment the stage processes need.

    With ``add_virtual`` (the launcher, before it starts the ranks), the cpu backend's stages
    get as many virtual devices of the same capacity as they need (``XPU_CPU_DEVICES``) when
    the config gives no ``devices`` map; otherwise there must be a device per stage, or every
    device the map names.

    Raises:
        MPressConfigError: too few devices, a map naming a device the backend lacks, or a budget
            larger than a stage's device.
    """
    from xpu.units import format_bytes

    env: dict[str, str] = {}
    devices = list(backend.topology().devices)
    if config.devices is not None:  # the devices named must exist: none are made up for a map
        try:
            config.job().check_devices(config.stages, len(devices), backend.name, key="strategy.options.devices")
        except ValueError as exc:
            raise MPressConfigError(str(exc)) from None
    # A comma list of capacities names each device: more of them cannot be made up.
    short = config.devices is None and len(devices) < config.stages
    made_up = backend.env_for_device_count(config.stages) if add_virtual and short else None
    if made_up:
        env.update(made_up)
        devices += [devices[0]] * (config.stages - len(devices))
    if config.devices is None and len(devices) < config.stages:
        raise MPressConfigError(f"{config.stages} stages need {config.stages} devices, one each; backend "
                                f"'{backend.name}' has {len(devices)}: lower --stages, make more devices visible, or "
                                f"put stages on one device with strategy.options.devices")
    budget = config.budget
    if budget is not None:
        for index in sorted({config.job().device_of(s) for s in range(config.stages)}):
            d = devices[index]
            if budget > d.total_bytes:
                raise MPressConfigError(f"device_budget (--budget-gb) {format_bytes(budget)} exceeds device {index}'s "
                                        f"{format_bytes(d.total_bytes)}; lower it, or set it to null for the whole device")
    return env
