"""The training config: its sections, its validation (every key and value checked before anything
is built), and how a YAML file plus ``--set`` overrides become one (:func:`load_config`).

YAML shape (every key but ``model`` optional)::

    name: gpt-tiny                 # default: the file's name
    description: ...
    model: {family: gpt, layers: 4, hidden: 128, heads: 4, vocab: 256}   # strategies.models families
    # or {family: hf, path: models/tiny-llama, lora: {r: 8, alpha: 16}}  (a local save_pretrained folder)
    strategy:                      # or just a name: `strategy: torch`
      name: memferry               # memferry | torch (see strategies.training.registry)
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
                                   # or {kind: jsonl, path: docs.jsonl, field: text, tokenizer: DIR_OR_tokenizer.json}
                                   #   (prompt_field: prompt: loss on `field` alone, each record's prompt before it;
                                   #    messages_field: messages: chat-templated, loss on the assistant turns alone;
                                   #    packing: false: one whole record per row, padded, instead of packed windows;
                                   #    with it, group_by_length: true: batches of records of like length)
                                   # or {kind: tokens, path: tokens.npy} (or .bin with dtype: uint16 | uint32)
                                   # any kind: eval_fraction: 0.05 (the corpus's last 5 % is held out for eval)
    accumulation_steps: 1          # micro-batches of `batch` rows per optimizer step (loss: their mean)
    eval_every: 0                  # mean loss over eval_batches held-out batches every K steps and at the end (0: off)
    eval_batches: 4
    log_every: 25
    checkpoint: {every: 100, dir: runs/gpt-tiny}   # also written after the last step; keep: N (last N only),
                                                   # overwrite: true (delete another run's step-*.pt there first)
    resume: runs/gpt-tiny          # a checkpoint file, or a folder (its latest step-*.pt)
    logging: {csv: runs/gpt-tiny/log.csv, tensorboard: runs/gpt-tiny/tb,   # per-step rows (rank 0 only);
              wandb: {project: xpu, name: gpt-tiny}}                      # see strategies.training.log_sinks

Relative ``data.path``, ``data.tokenizer`` and (``hf``) ``model.path`` are looked up next to the
config file first, then in the working directory (:meth:`TrainConfig.local_path`).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from xpu.errors import XpuError

from .checks import apply_overrides, check_model_section, model_dims, nonneg_int, positive_int, positive_number, read_config_source

__all__ = ["TrainConfig", "StrategyConfig", "OptimizerConfig", "DataConfig", "CheckpointConfig", "LoggingConfig", "TrainConfigError",
           "CheckpointWriteError", "TrainingDivergedError", "load_config", "resolve_dtype", "TEXT_VOCAB"]

#: Byte-level text: one token per byte.
TEXT_VOCAB = 256
_DTYPES = ("auto", "fp32", "bf16")
_SCHEDULES = ("constant", "cosine")
_DATA_KINDS = ("synthetic", "text", "jsonl", "tokens")


class TrainConfigError(XpuError, ValueError):
    """A training config that cannot run as written; the message says what is wrong and what is valid."""


class CheckpointWriteError(XpuError, OSError):
    """A checkpoint could not be written (disk full, read-only folder); the earlier checkpoints are intact."""


class TrainingDivergedError(XpuError, ArithmeticError):
    """The loss became NaN or infinite; the run stopped without checkpointing that state."""


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
    """Where batches come from (see :mod:`.data` and :mod:`.corpora`).

    Attributes:
        kind: ``synthetic`` (Markov chain with ``branching``), ``text`` (``path``, byte-level),
            ``jsonl`` (``path``: one JSON object per line, its ``field`` tokenized with ``tokenizer``,
            documents joined by the EOS id) or ``tokens`` (``path``: a 1-D ``.npy``, or a raw ``.bin`` of ``dtype``).
        tokenizer: a local Hugging Face tokenizer folder or a ``tokenizer.json`` file (jsonl only).
        prompt_field: jsonl only: each record's prompt (this field) comes before its ``field`` in the
            stream, and no loss is taken on predicting prompt tokens (their targets are -100), as
            completion-only fine-tuning does; None: every token is a target.
        messages_field: jsonl only: each record's conversation (this field: a list of ``{"role",
            "content"}`` messages) rendered with the tokenizer folder's chat template, and loss taken
            on the assistant turns alone (:mod:`.chat`); ``field`` and ``prompt_field`` are then unused.
        packing: jsonl only. True: records joined into one stream and drawn as windows of ``seq + 1``
            tokens (a window may span records and start inside one). False: one whole record per
            row, cut at ``seq + 1`` tokens and right-padded, never trained on its padding
            (:class:`~.data.RecordRows`): each completion or assistant turn sees its whole record.
        group_by_length: with ``packing: false``, batches of records of like length (each epoch's
            order sorted by length within groups of 50 batches, as HF Trainer's ``group_by_length``),
            so less of each batch is padding.
        eos_id: the id put between documents when the tokenizer names no EOS token (jsonl only).
        eval_fraction: the share of the corpus, at its end, held out for evaluation (training never reads it).
    """

    kind: str = "synthetic"
    path: str | None = None
    branching: int = 4
    field: str = "text"
    tokenizer: str | None = None
    prompt_field: str | None = None
    messages_field: str | None = None
    packing: bool = True
    group_by_length: bool = False
    eos_id: int | None = None
    dtype: str = "uint16"
    eval_fraction: float = 0.0


@dataclass
class CheckpointConfig:
    """Write a checkpoint every ``every`` steps (and after the last one) into ``dir``.

    Attributes:
        keep: keep only this run's last ``keep`` checkpoints after each save (None: all).
        overwrite: a fresh run may start in a folder holding another run's ``step-*.pt``; they are deleted
            when the run starts (without it such a run is refused).
    """

    dir: str
    every: int = 0
    keep: int | None = None
    overwrite: bool = False


@dataclass
class LoggingConfig:
    """Where each step's row is also written (:mod:`.log_sinks`); every one optional.

    Attributes:
        csv: a CSV file (a resumed run appends to it).
        tensorboard: a TensorBoard log folder (needs the ``tensorboard`` package).
        wandb: ``{project: P, name: N, entity: E, mode: online|offline|disabled}`` for Weights & Biases
            (needs ``wandb``; ``name`` defaults to the config's name).
    """

    csv: str | None = None
    tensorboard: str | None = None
    wandb: dict[str, Any] | None = None


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
    #: Bytes once validated (the YAML may say ``16GB``); None: the whole device.
    device_budget: str | int | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    steps: int = 100
    batch: int = 8
    seq: int = 256
    dtype: str = "auto"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    accumulation_steps: int = 1
    eval_every: int = 0
    eval_batches: int = 4
    log_every: int = 10
    checkpoint: CheckpointConfig | None = None
    resume: str | None = None
    logging: LoggingConfig | None = None
    #: Folder that relative ``data.path`` values are looked up in first (the config file's); not a YAML key.
    base_dir: str | None = field(default=None, metadata={"internal": True})

    # ------------------------------------------------------------------ derived
    @property
    def family(self) -> str:
        """The model family."""
        return self.model["family"]

    def model_dims(self) -> dict[str, Any]:
        """Model dimensions with ``seq`` included (what ``strategies.models.build_model`` takes)."""
        return model_dims(self.model, self.seq)

    def vocab(self) -> int | None:
        """The model's vocabulary size (an ``hf`` model's from its config or ``path``'s config.json; None if not given)."""
        if self.family == "hf":
            value = _hf_fields(self.model).get("vocab_size")
            return int(value) if value is not None else None
        return int(self.model["vocab"])

    def n_blocks(self) -> int | None:
        """Number of transformer blocks (None for an ``hf`` config that does not say)."""
        if self.family == "hf":
            cfg = _hf_fields(self.model)
            value = cfg.get("num_hidden_layers", cfg.get("n_layer"))
            return int(value) if value is not None else None
        return int(self.model["layers"])

    def data_path(self, value: str | None = None) -> Path:
        """The file of ``data.path`` (or ``value``), found as :meth:`local_path` finds it."""
        return self.local_path(self.data.path if value is None else value)

    def local_path(self, value: str | Path) -> Path:
        """An input path of the config: next to the config file if it exists there, else from the working directory."""
        path = Path(str(value)).expanduser()
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
        if data.get("logging") is not None:
            data["logging"] = _section(LoggingConfig, "logging", data["logging"])
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
        if isinstance(self.model, dict) and self.model.get("family") == "hf" and isinstance(self.model.get("path"), str):
            # found as data.path is; recorded resolved, so a checkpoint's config (xpu export) finds it from anywhere
            found = self.local_path(self.model["path"])
            if found != Path(self.model["path"]).expanduser():
                self.model["path"] = str(found)
        check_model_section(self.model, self.family, self.model_dims(), TrainConfigError)
        for key in ("steps", "batch", "seq", "log_every", "accumulation_steps", "eval_batches"):
            _positive_int(key, getattr(self, key))
        _nonneg_int("seed", self.seed)
        _nonneg_int("eval_every", self.eval_every)
        if self.model_dims().get("seq") is not None and self.model_dims()["seq"] < self.seq:
            raise TrainConfigError(f"model.seq ({self.model['seq']}) is shorter than seq ({self.seq}); drop model.seq or raise it")
        if self.dtype not in _DTYPES:
            raise TrainConfigError(f"dtype {self.dtype!r} is not valid; valid: {', '.join(_DTYPES)}")
        if self.device_budget is not None:  # parsed here, once: everything after sees bytes
            from xpu.units import parse_bytes

            try:
                self.device_budget = parse_bytes(self.device_budget)
                if self.device_budget <= 0:
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
            if self.checkpoint.keep is not None:
                _positive_int("checkpoint.keep", self.checkpoint.keep)
            if not isinstance(self.checkpoint.overwrite, bool):
                raise TrainConfigError(f"checkpoint.overwrite must be true or false, got {self.checkpoint.overwrite!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            raise TrainConfigError(f"resume must be a checkpoint file or folder path, got {self.resume!r}")
        if self.logging is not None:
            from .log_sinks import check_logging  # the sinks' own checks: paths, wandb keys, installed packages

            check_logging(self)

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
        frac = d.eval_fraction
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 <= frac < 1:
            raise TrainConfigError(f"data.eval_fraction must lie in [0, 1) (the held-out share of the corpus), got {frac!r}")
        if self.eval_every and not frac:
            raise TrainConfigError("eval_every needs held-out data: set data.eval_fraction (e.g. 0.05), or eval_every: 0")
        vocab = self.vocab()
        if d.prompt_field is not None and (d.kind != "jsonl" or not isinstance(d.prompt_field, str) or not d.prompt_field
                                           or d.prompt_field == d.field):
            raise TrainConfigError(f"data.prompt_field {d.prompt_field!r}: it names a jsonl record's prompt field, other "
                                   f"than data.field {d.field!r} (data kind jsonl only)")
        if d.messages_field is not None and (d.kind != "jsonl" or not isinstance(d.messages_field, str)
                                             or not d.messages_field or d.prompt_field is not None):
            raise TrainConfigError(f"data.messages_field {d.messages_field!r}: it names a jsonl record's list of chat "
                                   f"messages (data kind jsonl only), and takes the place of data.prompt_field")
        if not isinstance(d.packing, bool) or (not d.packing and d.kind != "jsonl"):
            raise TrainConfigError(f"data.packing {d.packing!r}: true or false, and false only for data kind jsonl "
                                   f"(whose records it keeps one per row)")
        if not isinstance(d.group_by_length, bool) or (d.group_by_length and d.packing):
            raise TrainConfigError(f"data.group_by_length {d.group_by_length!r}: true or false, and true only with "
                                   f"data.packing: false (packed windows hold no padding to save)")
        if d.kind == "synthetic":
            if d.path is not None:
                raise TrainConfigError("data.path is for kinds text, jsonl and tokens; synthetic data takes only 'branching'")
            _positive_int("data.branching", d.branching)
            if vocab is None:
                raise TrainConfigError("synthetic data needs the model's vocab size: give model.config.vocab_size")
            if d.branching > vocab:
                raise TrainConfigError(f"data.branching ({d.branching}) cannot exceed the model's vocab ({vocab})")
            return
        if not d.path or not isinstance(d.path, str):
            raise TrainConfigError(f"data kind {d.kind!r} needs 'path': a local file")
        if d.kind == "text" and vocab is not None and vocab < TEXT_VOCAB:
            raise TrainConfigError(f"text data is byte-level ({TEXT_VOCAB} tokens) but the model's vocab is {vocab}; "
                                   f"set model.vocab to at least {TEXT_VOCAB}")
        path = self.data_path()
        if not path.is_file():
            where = f" (looked in {self.base_dir} and the working directory)" if self.base_dir else ""
            raise TrainConfigError(f"data.path {d.path!r}: no such file{where}")
        if d.kind in ("jsonl", "tokens"):
            from .corpora import check_corpus_file  # the file kinds' own checks

            check_corpus_file(self, path)
            return
        size = path.stat().st_size
        if size < self.seq + 2:
            raise TrainConfigError(f"data.path {d.path!r} holds {size} bytes; a window of seq + 1 = {self.seq + 1} "
                                   f"tokens needs at least {self.seq + 2}: lower seq or use a longer file")

    def _validate_strategy(self) -> None:
        from .registry import get_strategy  # the registry's specs check their own options

        s = self.strategy
        spec = get_strategy(s.name)
        if not isinstance(s.options, dict):
            raise TrainConfigError(f"strategy.options must be a mapping, got {s.options!r}")
        bad = set(s.options) - set(spec.options)
        if bad:
            raise TrainConfigError(f"strategy {s.name!r} has no option(s) {sorted(bad)}; "
                                   f"valid options: {', '.join(sorted(spec.options)) or 'none'}")
        s.options = {**copy.deepcopy(spec.options), **s.options}
        if spec.check is not None:
            spec.check(s.options, self)


def _hf_fields(model: dict[str, Any]) -> dict[str, Any]:
    from strategies.models.hf_config import hf_config_dict  # the hf family's config (or path's config.json)

    return hf_config_dict(model)


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
        raise TrainConfigError(f"strategy needs a 'name' ({_strategy_names()}), e.g. {{name: memferry, options: {{plan: prefetch}}}}")
    if isinstance(value, dict):
        config = _section(StrategyConfig, "strategy", value)
        config.options = dict(config.options or {})
        return config
    raise TrainConfigError(f"strategy is a name ({_strategy_names()}) or {{name:, options:}}; got {value!r}")


def _strategy_names() -> str:
    from .registry import STRATEGIES

    return ", ".join(STRATEGIES.names())


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



def resolve_dtype(config: TrainConfig, backend: Any) -> tuple[str, torch.dtype]:
    """The compute dtype's name and torch dtype for ``config`` on ``backend`` ("auto" resolved)."""
    # bf16 where there is a real device with asynchronous copies; fp32 on the cpu reference,
    # where bf16 is slow and exactness checks want fp32 (as examples/memferry_gpt.py decides).
    name = config.dtype if config.dtype != "auto" else ("bf16" if backend.caps.async_copy else "fp32")
    return name, {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
