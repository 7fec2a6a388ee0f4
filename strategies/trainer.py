"""Run a training loop from a validated config: what ``xpu train CONFIG.yaml`` does, usable from Python.

    from strategies.trainer import load_config, train
    result = train(load_config("examples/train/gpt-tiny-memferry.yaml", {"steps": 50}))
    print(result.losses[0], result.losses[-1], result.peak_device_bytes)

The whole config is checked before anything is built, and every error names the valid keys
or values. YAML shape (every key but ``model`` optional)::

    name: gpt-tiny                 # default: the file's name
    description: ...
    model: {family: gpt, layers: 4, hidden: 128, heads: 4, vocab: 256}   # bench.models families
    strategy:                      # or just a name: `strategy: torch`
      name: memferry               # memferry | torch (see STRATEGIES)
      options: {plan: prefetch+recompute, max_grad_norm: 1.0}
    device_budget: 16GB            # most device memory the run may use (null: the whole device)
    optimizer: {lr: 1.0e-3, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 0.01,
                schedule: cosine, warmup_steps: 20, min_lr: 1.0e-4}       # schedule: constant | cosine
    steps: 400                     # total optimizer steps (a resumed run continues up to this)
    batch: 16
    seq: 64
    dtype: auto                    # auto: bf16 on an accelerator, fp32 on the cpu backend; fp32 | bf16
    seed: 0
    data: {kind: synthetic, branching: 4}   # or {kind: text, path: data/tiny.txt} (byte-level, vocab 256)
    log_every: 25
    checkpoint: {every: 100, dir: runs/gpt-tiny}   # also written after the last step
    resume: runs/gpt-tiny          # a checkpoint file, or a folder (its latest step-*.pt)

Data. ``text`` reads a local file as bytes (token = byte, so the model's vocab must be at
least 256); a relative path is looked up next to the config file first, then in the working
directory. ``synthetic`` is a seeded Markov chain over the model's vocabulary in which every
token has ``branching`` possible successors, so the loss falls from about ln(vocab) towards
ln(branching) as the model learns the table. Either way each step draws ``batch`` random
windows of ``seq + 1`` tokens (inputs, then targets shifted by one) from one seeded
generator, whose state is saved in checkpoints: a resumed run sees the batches the
uninterrupted run would have seen, and (on a deterministic backend) the same losses. The
learning rate is a function of the step and ``steps``, so resuming with a larger ``steps``
stretches a cosine schedule from that point on.

Strategies are registered in :data:`STRATEGIES`, one line each: a builder that takes the
host-built model and returns an object with ``train_step / set_lr / state_dict /
load_state_dict / synchronize / close`` (:class:`TrainEngine`).
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

from bench.config_checks import (apply_overrides, check_model_section, nonneg_int, positive_int, positive_number,
                                 read_config_source)
from xpu.errors import XpuError

__all__ = [
    "TrainConfig", "StrategyConfig", "OptimizerConfig", "DataConfig", "CheckpointConfig", "TrainConfigError",
    "StrategySpec", "STRATEGIES", "TrainEngine", "TokenWindows", "StepReport", "RunInfo", "TrainCallback",
    "TrainResult", "load_config", "train", "lr_at", "markov_corpus", "find_checkpoint", "make_data", "resolve_dtype",
    "TEXT_VOCAB",
]

#: Byte-level text: one token per byte.
TEXT_VOCAB = 256
_DTYPES = ("auto", "fp32", "bf16")
_SCHEDULES = ("constant", "cosine")
_DATA_KINDS = ("synthetic", "text")
#: Tokens of the synthetic corpus: enough that a 32k vocabulary's table is visited ~30 times per token.
_SYNTHETIC_TOKENS = 1 << 20
_CHECKPOINT_FORMAT = 1


class TrainConfigError(XpuError, ValueError):
    """A training config that cannot run as written; the message says what is wrong and what is valid."""


# ---------------------------------------------------------------------------------- config sections
@dataclass
class StrategyConfig:
    """Which strategy trains the model, and its options (defaults from :data:`STRATEGIES`)."""

    name: str = "memferry"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    """AdamW settings and the learning-rate schedule.

    Attributes:
        lr: peak learning rate.
        betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        schedule: ``constant``, or ``cosine`` decay from ``lr`` to ``min_lr`` over the steps after warm-up.
        warmup_steps: linear warm-up from ``lr / warmup_steps`` to ``lr`` (0: none).
        min_lr: the cosine schedule's final learning rate.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0


@dataclass
class DataConfig:
    """Where batches come from: ``synthetic`` (Markov chain with ``branching``) or ``text`` (``path``, byte-level)."""

    kind: str = "synthetic"
    path: str | None = None
    branching: int = 4


@dataclass
class CheckpointConfig:
    """Write a checkpoint every ``every`` steps (and after the last one) into ``dir``."""

    dir: str
    every: int = 0


@dataclass
class TrainConfig:
    """Everything one training run needs (see the module docstring for the YAML shape).

    Build one with :func:`load_config` (YAML path or dict, plus overrides) or
    :meth:`from_dict`; both validate in full.
    """

    model: dict[str, Any]
    name: str = "train"
    description: str = ""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    device_budget: str | int | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    steps: int = 100
    batch: int = 8
    seq: int = 256
    dtype: str = "auto"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    log_every: int = 10
    checkpoint: CheckpointConfig | None = None
    resume: str | None = None
    #: Folder that relative ``data.path`` values are looked up in first (the config file's); not a YAML key.
    base_dir: str | None = field(default=None, metadata={"internal": True})

    # ------------------------------------------------------------------ derived
    @property
    def family(self) -> str:
        """The model family."""
        return self.model["family"]

    def model_dims(self) -> dict[str, Any]:
        """Model dimensions with ``seq`` included (what ``bench.models.build_model`` takes)."""
        dims = {k: v for k, v in self.model.items() if k != "family"}
        dims.setdefault("seq", self.seq)
        return dims

    def vocab(self) -> int | None:
        """The model's vocabulary size (None for an ``hf`` config that leaves it to transformers)."""
        if self.family == "hf":
            value = self.model["config"].get("vocab_size")
            return int(value) if value is not None else None
        return int(self.model["vocab"])

    def n_blocks(self) -> int | None:
        """Number of transformer blocks (None for an ``hf`` config that does not say)."""
        if self.family == "hf":
            cfg = self.model["config"]
            value = cfg.get("num_hidden_layers", cfg.get("n_layer"))
            return int(value) if value is not None else None
        return int(self.model["layers"])

    def data_path(self) -> Path:
        """The text file of ``data.path``: next to the config file if it exists there, else from the working directory."""
        path = Path(str(self.data.path)).expanduser()
        if not path.is_absolute() and self.base_dir is not None and (Path(self.base_dir) / path).exists():
            return Path(self.base_dir) / path
        return path

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str | None = None, base_dir: str | Path | None = None) -> "TrainConfig":
        """Build and validate a config from a YAML-shaped dict.

        Raises:
            TrainConfigError: unknown or bad keys or values; the message lists the valid ones.
        """
        if not isinstance(data, dict):
            raise TrainConfigError(f"a training config must be a mapping of keys to values, got {type(data).__name__}")
        data = copy.deepcopy(data)
        valid = _public_keys(cls)
        unknown = set(data) - set(valid)
        if unknown:
            raise TrainConfigError(f"unknown key(s) {sorted(unknown)}; valid keys: {', '.join(valid)}")
        if "model" not in data:
            raise TrainConfigError("a training config needs 'model': {family: gpt|llama|hf, <dimensions>}")
        data["strategy"] = _section_strategy(data.get("strategy", "memferry"))
        data["optimizer"] = _section(OptimizerConfig, "optimizer", data.get("optimizer") or {})
        data["data"] = _section(DataConfig, "data", data.get("data") or {})
        if data.get("checkpoint") is not None:
            ck = data["checkpoint"]
            if isinstance(ck, dict) and "dir" not in ck:
                raise TrainConfigError("checkpoint needs 'dir' (the folder to write step-N.pt files to), e.g. {every: 100, dir: runs/x}")
            data["checkpoint"] = _section(CheckpointConfig, "checkpoint", ck)
        if name and "name" not in data:
            data["name"] = name
        config = cls(**data, base_dir=str(base_dir) if base_dir is not None else None)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        """A YAML/JSON-friendly dict that :meth:`from_dict` reads back (what checkpoints record)."""
        out = asdict(self)
        out.pop("base_dir")
        out["optimizer"]["betas"] = list(out["optimizer"]["betas"])
        return out

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every value and fill in strategy option defaults.

        Raises:
            TrainConfigError: what is wrong, with the valid values.
        """
        check_model_section(self.model, self.family, self.model_dims(), TrainConfigError)
        for key in ("steps", "batch", "seq", "log_every"):
            _positive_int(key, getattr(self, key))
        _nonneg_int("seed", self.seed)
        if self.model_dims().get("seq") is not None and self.model_dims()["seq"] < self.seq:
            raise TrainConfigError(f"model.seq ({self.model['seq']}) is shorter than seq ({self.seq}); drop model.seq or raise it")
        if self.dtype not in _DTYPES:
            raise TrainConfigError(f"dtype {self.dtype!r} is not valid; valid: {', '.join(_DTYPES)}")
        if self.device_budget is not None:
            from xpu.units import parse_bytes

            try:
                if parse_bytes(self.device_budget) <= 0:
                    raise ValueError("a device budget must be positive")
            except ValueError as exc:
                raise TrainConfigError(f"device_budget: {exc}") from None
        self._validate_optimizer()
        self._validate_data()
        self._validate_strategy()
        if self.checkpoint is not None:
            _nonneg_int("checkpoint.every", self.checkpoint.every)
            if not isinstance(self.checkpoint.dir, str) or not self.checkpoint.dir:
                raise TrainConfigError(f"checkpoint.dir must be a folder path, got {self.checkpoint.dir!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            raise TrainConfigError(f"resume must be a checkpoint file or folder path, got {self.resume!r}")

    def _validate_optimizer(self) -> None:
        o = self.optimizer
        for key in ("lr", "eps"):
            _positive_number(f"optimizer.{key}", getattr(o, key))
        for key in ("weight_decay", "min_lr"):
            value = getattr(o, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise TrainConfigError(f"optimizer.{key} must be a non-negative number, got {value!r}")
        if (not isinstance(o.betas, (list, tuple)) or len(o.betas) != 2
                or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas)):
            raise TrainConfigError(f"optimizer.betas must be two numbers in [0, 1), got {o.betas!r}")
        o.betas = (float(o.betas[0]), float(o.betas[1]))
        if o.schedule not in _SCHEDULES:
            raise TrainConfigError(f"optimizer.schedule {o.schedule!r} is not valid; valid: {', '.join(_SCHEDULES)}")
        _nonneg_int("optimizer.warmup_steps", o.warmup_steps)
        if o.min_lr > o.lr:
            raise TrainConfigError(f"optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr})")

    def _validate_data(self) -> None:
        d = self.data
        if d.kind not in _DATA_KINDS:
            raise TrainConfigError(f"data.kind {d.kind!r} is not valid; valid: {', '.join(_DATA_KINDS)}")
        vocab = self.vocab()
        if d.kind == "synthetic":
            if d.path is not None:
                raise TrainConfigError("data.path is for kind: text; synthetic data takes only 'branching'")
            _positive_int("data.branching", d.branching)
            if vocab is None:
                raise TrainConfigError("synthetic data needs the model's vocab size: give model.config.vocab_size")
            if d.branching > vocab:
                raise TrainConfigError(f"data.branching ({d.branching}) cannot exceed the model's vocab ({vocab})")
            return
        if not d.path or not isinstance(d.path, str):
            raise TrainConfigError("data kind 'text' needs 'path': a local text file, read byte-level")
        if vocab is not None and vocab < TEXT_VOCAB:
            raise TrainConfigError(f"text data is byte-level ({TEXT_VOCAB} tokens) but the model's vocab is {vocab}; "
                                   f"set model.vocab to at least {TEXT_VOCAB}")
        path = self.data_path()
        if not path.is_file():
            where = f" (looked in {self.base_dir} and the working directory)" if self.base_dir else ""
            raise TrainConfigError(f"data.path {d.path!r}: no such file{where}")
        size = path.stat().st_size
        if size < self.seq + 2:
            raise TrainConfigError(f"data.path {d.path!r} holds {size} bytes; a window of seq + 1 = {self.seq + 1} "
                                   f"tokens needs at least {self.seq + 2}: lower seq or use a longer file")

    def _validate_strategy(self) -> None:
        s = self.strategy
        if s.name not in STRATEGIES:
            raise TrainConfigError(f"unknown strategy {s.name!r}; valid strategies: {', '.join(STRATEGIES)}")
        spec = STRATEGIES[s.name]
        if not isinstance(s.options, dict):
            raise TrainConfigError(f"strategy.options must be a mapping, got {s.options!r}")
        bad = set(s.options) - set(spec.options)
        if bad:
            raise TrainConfigError(f"strategy {s.name!r} has no option(s) {sorted(bad)}; "
                                   f"valid options: {', '.join(sorted(spec.options)) or 'none'}")
        s.options = {**copy.deepcopy(spec.options), **s.options}
        if spec.check is not None:
            spec.check(s.options, self)


def _public_keys(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if not f.metadata.get("internal")]


def _section(cls: type, label: str, value: Any) -> Any:
    if not isinstance(value, dict):
        raise TrainConfigError(f"'{label}' must be a mapping with keys {', '.join(_public_keys(cls))}; got {value!r}")
    unknown = set(value) - set(_public_keys(cls))
    if unknown:
        raise TrainConfigError(f"unknown {label} key(s) {sorted(unknown)}; valid: {', '.join(_public_keys(cls))}")
    return cls(**value)


def _section_strategy(value: Any) -> StrategyConfig:
    if isinstance(value, str):
        return StrategyConfig(value)
    if isinstance(value, dict) and "name" not in value:
        raise TrainConfigError(f"strategy needs a 'name' ({', '.join(STRATEGIES)}), e.g. {{name: memferry, options: {{plan: prefetch}}}}")
    if isinstance(value, dict):
        config = _section(StrategyConfig, "strategy", value)
        config.options = dict(config.options or {})
        return config
    raise TrainConfigError(f"strategy is a name ({', '.join(STRATEGIES)}) or {{name:, options:}}; got {value!r}")


def _positive_int(key: str, value: Any) -> None:
    positive_int(key, value, TrainConfigError)


def _nonneg_int(key: str, value: Any) -> None:
    nonneg_int(key, value, TrainConfigError)


def _positive_number(key: str, value: Any) -> None:
    positive_number(key, value, TrainConfigError)


def load_config(source: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Load a config from a YAML path or a dict, apply dotted ``overrides``, validate.

    ``overrides`` maps dotted keys to values, e.g. ``{"model.layers": 2, "steps": 20}``.

    Raises:
        TrainConfigError: missing file, unreadable YAML, a bad override or an invalid config.
    """
    data, path = read_config_source(source, TrainConfigError)
    name, base_dir = (path.stem, path.resolve().parent) if path is not None else (None, None)
    # `--set strategy.options.x=` on a bare-name strategy; `--set checkpoint.dir=` on `checkpoint: null`
    apply_overrides(data, overrides, TrainConfigError, promote={"strategy": "name"})
    return TrainConfig.from_dict(data, name=name, base_dir=base_dir)


# ---------------------------------------------------------------------------------- learning rate
def lr_at(opt: OptimizerConfig, step: int, total: int) -> float:
    """Learning rate of update number ``step`` (0-based) out of ``total``: warm-up, then constant or cosine.

    A function of the step alone, so a resumed run follows the same schedule.
    """
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------- data
def markov_corpus(vocab: int, branching: int, length: int, seed: int) -> torch.Tensor:
    """``length`` tokens of a seeded Markov chain where each token has ``branching`` possible successors.

    Generated as 256 independent chains side by side (a loop over positions, vectorised over
    chains) and concatenated; the rare window that spans two chains is noise the model shrugs off.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=g)
    chains = 256
    per_chain = -(-length // chains)
    state = torch.randint(0, vocab, (chains,), generator=g)
    out = torch.empty(chains, per_chain, dtype=torch.long)
    for t in range(per_chain):
        out[:, t] = state
        state = successors[state, torch.randint(0, branching, (chains,), generator=g)]
    return out.reshape(-1)[:length]


class TokenWindows:
    """Batches of random windows of ``seq + 1`` tokens from a 1-D corpus, drawn with one seeded generator.

    Args:
        corpus: 1-D integer tensor of token ids (uint8 for byte-level text keeps a file at one byte per token).
        batch, seq: windows per batch and tokens per input row.
        seed: the generator's seed; :meth:`state_dict` / :meth:`load_state_dict` carry its position.
    """

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int) -> None:
        if corpus.dim() != 1 or corpus.numel() < seq + 2:
            raise ValueError(f"the corpus needs at least seq + 2 = {seq + 2} tokens in one dimension, got shape {tuple(corpus.shape)}")
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each (batch, seq) int64 on the host; targets are inputs shifted by one."""
        starts = torch.randint(0, self.corpus.numel() - self.seq, (self.batch,), generator=self.generator)
        windows = self.corpus[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """The generator's position."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` gave."""
        self.generator.set_state(state["generator"])


def make_data(config: TrainConfig) -> tuple[TokenWindows, str]:
    """The batch source and a one-line description of it."""
    if config.data.kind == "text":
        path = config.data_path()
        corpus = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        try:  # the short form in messages when the file is under the working directory
            shown = path.resolve().relative_to(Path.cwd())
        except ValueError:
            shown = path
        return TokenWindows(corpus, config.batch, config.seq, config.seed), f"text {shown} ({corpus.numel():,} bytes)"
    vocab = config.vocab()
    assert vocab is not None  # validate() checked
    corpus = markov_corpus(vocab, config.data.branching, _SYNTHETIC_TOKENS, config.seed)
    floor = math.log(config.data.branching)
    return (TokenWindows(corpus, config.batch, config.seq, config.seed + 1),
            f"synthetic Markov chain, vocab {vocab}, {config.data.branching} successors per token (loss floor ~{floor:.2f})")


# ---------------------------------------------------------------------------------- strategies
class TrainEngine(Protocol):
    """What a strategy builder returns; ``MemFerry`` has this shape."""

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward and update; returns the loss (detached, any device)."""

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next update."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training (weights and optimizer state)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave."""

    def synchronize(self) -> None:
        """Wait for pending work."""

    def close(self) -> None:
        """Release what the engine holds."""


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy.

    Attributes:
        build: ``build(model, config, backend, device) -> TrainEngine``; the model is built on
            the host in the compute dtype (in fp32 with ``fp32_model``), seeded; the device
            memory cap is already set.
        options: option names and defaults (unknown options in a config are errors).
        description: one line for listings and errors.
        check: ``check(options, config)`` raising :class:`TrainConfigError` for bad option
            values, run at validation, before anything is built.
        takes_budget: the builder enforces ``device_budget`` itself (else the trainer sets the cap).
        fp32_model: the builder takes the model in fp32 and computes in the config's dtype, so
            its fp32 masters start from the fp32 initial values, not from their bf16 roundings.
    """

    build: Callable[[nn.Module, TrainConfig, Any, int], TrainEngine]
    options: dict[str, Any]
    description: str
    check: Callable[[dict[str, Any], TrainConfig], None] | None = None
    takes_budget: bool = False
    fp32_model: bool = False


def _check_grad_norm(options: dict[str, Any]) -> None:
    value = options.get("max_grad_norm")
    if value is not None:
        _positive_number("strategy.options.max_grad_norm", value)


def _check_memferry(options: dict[str, Any], config: TrainConfig) -> None:
    from strategies.memferry import Plan

    _check_grad_norm(options)
    if not isinstance(options["plan"], str):
        raise TrainConfigError(f"strategy.options.plan must be a plan name such as 'prefetch+recompute' or 'auto', "
                               f"got {options['plan']!r}")
    chunks = options["loss_chunks"]
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise TrainConfigError(f"strategy.options.loss_chunks must be a positive integer (1: the loss over all tokens "
                               f"at once), got {chunks!r}")
    margin = options["memory_margin"]
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise TrainConfigError(f"strategy.options.memory_margin must lie in [0, 1), got {margin!r}")
    n_blocks = config.n_blocks()
    if n_blocks is not None and options["plan"] != "auto":
        try:
            Plan.from_spec(options["plan"], n_blocks)
        except ValueError as exc:
            raise TrainConfigError(f"strategy.options.plan: {exc}") from None


def _build_memferry(model: nn.Module, config: TrainConfig, backend: Any, device: int) -> TrainEngine:
    from strategies.memferry import AdamW, MemFerry, Plan

    o, opts = config.optimizer, config.strategy.options
    cfg = AdamW(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=opts["max_grad_norm"])
    sample = None
    if opts["plan"] == "auto":  # the scheduler profiles one batch of the run's shape (its values do not matter)
        g = torch.Generator().manual_seed(config.seed)
        tokens = torch.randint(0, config.vocab() or 256, (config.batch, config.seq + 1), generator=g)
        sample = (tokens[:, :-1], tokens[:, 1:])
        plan: Any = "auto"
    else:
        plan = Plan.from_spec(opts["plan"], len(model.blocks))
    if opts["loss_chunks"] > 1:
        if not hasattr(model, "loss_chunks"):
            raise TrainConfigError("strategy.options.loss_chunks needs a model that slices its loss (gpt or llama)")
        model.loss_chunks = opts["loss_chunks"]
    # MemFerry is a TrainEngine as it is; its set_lr is queued behind pending host updates.
    return MemFerry(model, optim=cfg, device_budget=config.device_budget, plan=plan, backend=backend, device=device,
                    sample=sample, memory_margin=float(opts["memory_margin"]), compute_dtype=resolve_dtype(config, backend)[1],
                    blocks=model.blocks)  # named: a 1-block model has no list to find


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
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)

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

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next step."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Host copies of the weights, and torch's optimizer state."""
        self.synchronize()
        return {"model": {k: v.to("cpu", copy=True) for k, v in self.model.state_dict().items()},
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
STRATEGIES: dict[str, StrategySpec] = {
    "memferry": StrategySpec(_build_memferry, {"plan": "prefetch", "max_grad_norm": None, "loss_chunks": 1,
                                                "memory_margin": 0.10},
                             "MemFerry: parameters homed in host memory, per-block plan, host AdamW", _check_memferry,
                             takes_budget=True, fp32_model=True),
    "torch": StrategySpec(TorchEngine, {"max_grad_norm": None, "recompute": False},
                          "plain PyTorch reference: model and torch AdamW all on the device", _check_torch),
}


# ---------------------------------------------------------------------------------- checkpoints
def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or the highest ``step-N.pt`` in a folder.

    Raises:
        TrainConfigError: nothing there.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("step-*.pt"))
        if not found:
            raise TrainConfigError(f"resume: folder {str(path)!r} holds no step-*.pt checkpoint")
        return found[-1]
    if not p.is_file():
        raise TrainConfigError(f"resume: no checkpoint file or folder {str(path)!r}")
    return p


def _load_checkpoint(config: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """Read and check the resume checkpoint against the config (before anything is built)."""
    path = find_checkpoint(str(config.resume))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise TrainConfigError(f"resume: cannot read checkpoint {path}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT or "engine" not in state:
        raise TrainConfigError(f"resume: {path} is not an xpu train checkpoint")
    saved = state["config"]
    if saved["model"] != config.model:
        raise TrainConfigError(f"resume: {path} holds model {saved['model']}, the config asks for {config.model}")
    if saved["strategy"]["name"] != config.strategy.name:
        raise TrainConfigError(f"resume: {path} was written by strategy {saved['strategy']['name']!r}; "
                               f"the config uses {config.strategy.name!r}")
    if state["step"] >= config.steps:
        raise TrainConfigError(f"resume: {path} is at step {state['step']}, which already reaches steps={config.steps}; "
                               f"raise steps to train further")
    return path, state


def _save_checkpoint(directory: Path, step: int, engine: TrainEngine, data: TokenWindows, config: TrainConfig) -> Path:
    """Write ``step-N.pt`` atomically: a temporary file in the same folder, then a rename."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:07d}.pt"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    payload = {"format": _CHECKPOINT_FORMAT, "step": step, "engine": engine.state_dict(), "data": data.state_dict(),
               "config": config.to_dict()}
    try:
        torch.save(payload, tmp)
        os.replace(tmp, final)  # atomic on POSIX: a reader sees the old file set or the new one, never half a file
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


# ---------------------------------------------------------------------------------- the loop
@dataclass
class RunInfo:
    """What a run is about to do (given to :meth:`TrainCallback.on_start`)."""

    name: str
    backend: str
    device: int
    dtype: str
    params: int
    strategy: str
    options: dict[str, Any]
    device_budget: int | None
    data: str
    start_step: int
    steps: int
    tokens_per_step: int
    resumed_from: str | None
    plan: str | None = None  # the strategy's explained plan, when it chose one (MemFerry's scheduler)


@dataclass
class StepReport:
    """One finished step (given to :meth:`TrainCallback.on_step`).

    Attributes:
        step: 1-based step number; ``steps`` the total.
        loss: the step's loss; ``lr`` the rate it was updated with.
        step_s: wall seconds of the step, the loss read back included.
        peak_device_bytes: the device memory high-water mark of the run so far.
        log: True on every ``log_every``-th step and the last one.
        checkpoint: the file written after this step, if one was.
    """

    step: int
    steps: int
    loss: float
    lr: float
    step_s: float
    peak_device_bytes: int
    log: bool
    checkpoint: str | None = None


class TrainCallback:
    """Hooks :func:`train` calls; the defaults do nothing (the CLI's progress bar overrides them)."""

    def on_start(self, info: RunInfo) -> None:
        """Before the first step."""

    def on_step(self, report: StepReport) -> None:
        """After every step."""


@dataclass
class TrainResult:
    """What a run did.

    Attributes:
        steps: 1-based step numbers run here (a resumed run starts after the checkpoint's step).
        losses, lrs, step_times_s: per step run here.
        peak_device_bytes: device memory high-water mark (reserved) from engine set-up on.
        peak_allocated_bytes: the same for live tensors.
        wall_s: seconds from the first step to the end of the last, checkpoints included.
        tokens_per_s: trained tokens per second of step time.
        checkpoints: files written.
        info: the run's :class:`RunInfo`.
    """

    steps: list[int]
    losses: list[float]
    lrs: list[float]
    step_times_s: list[float]
    peak_device_bytes: int
    peak_allocated_bytes: int
    wall_s: float
    tokens_per_s: float
    checkpoints: list[str]
    info: RunInfo

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly."""
        return asdict(self)


def resolve_dtype(config: TrainConfig, backend: Any) -> tuple[str, torch.dtype]:
    """The compute dtype's name and torch dtype for ``config`` on ``backend`` ("auto" resolved)."""
    # bf16 where there is a real device with asynchronous copies; fp32 on the cpu reference,
    # where bf16 is slow and exactness checks want fp32 (as examples/memferry_gpt.py decides).
    name = config.dtype if config.dtype != "auto" else ("bf16" if backend.caps.async_copy else "fp32")
    return name, {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def train(config: TrainConfig, callback: TrainCallback | None = None, backend: Any = None) -> TrainResult:
    """Train ``config.model`` with ``config.strategy`` for ``config.steps`` steps (continuing a checkpoint if ``resume``).

    Everything that can be checked is checked before the model is built: the config
    (already, by :func:`load_config`), the device budget against the device, the resume
    checkpoint against the config, the data file. The process-wide device memory cap is put
    back as it was when the run ends.

    Raises:
        TrainConfigError: a budget larger than the device, an unusable checkpoint.
        torch.OutOfMemoryError: the run needs more device memory than the budget.
    """
    import xpu
    from bench.models import build_model
    from xpu.units import parse_bytes

    config.validate()  # idempotent; covers a TrainConfig built directly rather than by load_config
    callback = callback or TrainCallback()
    backend = backend or xpu.get_backend()
    device = backend.index_of(None)
    spec = STRATEGIES[config.strategy.name]
    budget = parse_bytes(config.device_budget) if config.device_budget is not None else None
    total = next(d.total_bytes for d in backend.topology().devices if d.index == device)
    if budget is not None and budget > total:
        raise TrainConfigError(f"device_budget {xpu.format_bytes(budget)} exceeds device {device}'s "
                               f"{xpu.format_bytes(total)} on the {backend.name} backend")
    resumed_from, state = _load_checkpoint(config) if config.resume else (None, None)
    if config.checkpoint is not None:
        try:  # an unwritable folder fails now, not after the first hour of training
            Path(config.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainConfigError(f"checkpoint.dir {config.checkpoint.dir!r}: {exc.strerror or exc}") from None
    data, data_desc = make_data(config)
    dtype_name, dtype = resolve_dtype(config, backend)

    # Seed a private copy of the host RNG: the same config builds the same initial weights
    # whatever the caller did before, and the caller's RNG stream is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config.family, dtype=torch.float32 if spec.fp32_model else dtype, **config.model_dims())
    params = sum(p.numel() for p in model.parameters())

    previous_cap = backend.memory_cap(device)
    engine: TrainEngine | None = None
    try:
        if budget is not None and not spec.takes_budget:
            backend.set_memory_cap(device, budget)
        engine = spec.build(model, config, backend, device)
        backend.reset_peak_memory(device)  # after set-up: a scheduler's profiling step is not the run
        start = 0
        if state is not None:
            engine.load_state_dict(state["engine"])
            data.load_state_dict(state["data"])
            start = int(state["step"])
        del model, state
        info = RunInfo(config.name, backend.name, device, dtype_name, params, config.strategy.name,
                       dict(config.strategy.options), budget, data_desc, start, config.steps,
                       config.batch * config.seq, str(resumed_from) if resumed_from else None,
                       engine.plan.describe() if config.strategy.options.get("plan") == "auto" else None)
        callback.on_start(info)
        steps, losses, lrs, times, checkpoints = [], [], [], [], []
        every = config.checkpoint.every if config.checkpoint else 0
        t_begin = time.perf_counter()
        for i in range(start, config.steps):
            lr = lr_at(config.optimizer, i, config.steps)
            engine.set_lr(lr)
            inputs, targets = data.next()
            t0 = time.perf_counter()
            loss = float(engine.train_step(inputs, targets))  # reading it back waits for this step's forward
            step_s = time.perf_counter() - t0
            n = i + 1
            saved = None
            if config.checkpoint is not None and ((every and n % every == 0) or n == config.steps):
                saved = str(_save_checkpoint(Path(config.checkpoint.dir), n, engine, data, config))
                checkpoints.append(saved)
            steps.append(n)
            losses.append(loss)
            lrs.append(lr)
            times.append(step_s)
            peak = backend.memory_stats(device).peak_reserved
            callback.on_step(StepReport(n, config.steps, loss, lr, step_s, peak,
                                        log=n % config.log_every == 0 or n == config.steps or n == start + 1,
                                        checkpoint=saved))
        engine.synchronize()
        wall = time.perf_counter() - t_begin
        stats = backend.memory_stats(device)
        step_total = sum(times)
        return TrainResult(steps, losses, lrs, times, stats.peak_reserved, stats.peak_allocated, wall,
                           config.batch * config.seq * len(times) / step_total if step_total else 0.0, checkpoints, info)
    finally:
        if engine is not None:
            engine.close()
        if backend.memory_cap(device) != previous_cap:
            backend.set_memory_cap(device, previous_cap)
