"""A benchmark scenario: one model, one data batch, one device-memory cap, several systems.

Loaded from YAML (``examples/bench/*.yaml``) and checked in full before anything runs: an
unknown key, model family, system or system option is an error that names the valid values.

YAML shape (every key but ``model`` and ``systems`` optional)::

    name: design-s3
    description: docs/design.md §3 anchor scenario
    model: {family: gpt, layers: 24, hidden: 2048, heads: 16, vocab: 32000}
    batch: 8            # the micro-batch (split between ranks where a system has several)
    seq: 1024
    accumulation_steps: 1  # micro-batches per optimizer step: a step = N forward/backwards + one update
    steps: 5             # timed steps (median and mean over these)
    warmup: 2            # untimed steps before them
    loss_after: 9        # report the loss after this many steps (runs extra untimed steps if needed)
    dtype: auto          # auto = bf16 on an accelerator, fp32 on the cpu backend; or fp32 | bf16 | fp16
    seed: 0
    device_mem_gb: null  # cap every system's device memory (a per-process fraction on CUDA)
    host_mem_gb: null    # host-memory cap (max-model search; a run past it reads "oom")
    optimizer: {lr: 1.0e-3, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 0.0}
    timeout_s: 1800      # per system
    timeline: true       # one profiled step per system, as a Chrome trace
    env: {}              # environment variables set in every system's worker (same for all), e.g.
                         # {PYTORCH_CUDA_ALLOC_CONF: "expandable_segments:True"}
    systems:
      - torch
      - {name: deepspeed-twinflow, label: deepspeed-twinflow-0.5, options: {ratio: 0.5}}
      - {name: deepspeed-zenflow, steps: 8, warmup: 1}
    max_model: {knob: layers, lo: 1, hi: 1024, steps: 2, warmup: 0}
    min_cap: {lo: 0, hi: null, resolution: 1}   # --min-cap: caps in GB (hi null: uncapped)
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from xpu.errors import XpuError

from strategies.training.checks import apply_overrides, check_model_section, load_yaml, model_dims, nonneg_int, positive_int

__all__ = ["Scenario", "SystemEntry", "MaxModelConfig", "MinCapConfig", "ScenarioError", "load_scenario", "resolve_scenario_path",
           "KNOBS", "EXAMPLES_DIR"]

#: Where named scenarios live (``xpu bench design-s3`` reads ``examples/bench/design-s3.yaml``).
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "bench"
#: Size knobs the max-model search can turn.
KNOBS = ("layers", "hidden")
_DTYPES = ("auto", "fp32", "bf16", "fp16")
_OPT_KEYS = {"lr", "betas", "eps", "weight_decay"}


class ScenarioError(XpuError, ValueError):
    """A scenario that cannot run as written; the message says what is wrong and what is valid."""


@dataclass
class SystemEntry:
    """One system of a scenario.

    Attributes:
        name: registered system name.
        label: the row's name (default: ``name``); must be unique within the scenario.
        options: system options (unknown ones are errors; defaults filled in by :meth:`Scenario.validate`).
        steps, warmup, device_mem_gb: per-system overrides of the scenario's values (None: inherit).
        uncapped: this system runs with no device cap whatever the scenario's; what an entry's
            explicit ``device_mem_gb: null`` means (written out as ``uncapped: true``).
    """

    name: str
    label: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    warmup: int | None = None
    device_mem_gb: float | None = None
    uncapped: bool = False

    def __post_init__(self) -> None:
        self.label = self.label or self.name


@dataclass
class MaxModelConfig:
    """How ``--max-model`` searches.

    Attributes:
        knob: which dimension grows: ``layers`` (depth) or ``hidden`` (width; heads fixed,
            hidden moves in steps of ``heads * 8``).
        lo, hi: the knob's search range (in layers, or in hidden units).
        steps, warmup: a trial "trains" if this many steps (after warm-up) run without error.
        resolution: bisection stops once the last success and the first failure are at most
            this far apart (in knob units as ``lo``/``hi``): 1 finds the exact largest; more
            saves trials where each costs minutes (the answer is then a lower bound within
            ``resolution`` of the largest).
    """

    knob: str = "layers"
    lo: int = 1
    hi: int = 1024
    steps: int = 2
    warmup: int = 0
    resolution: int = 1


@dataclass
class MinCapConfig:
    """How ``--min-cap`` searches (:mod:`bench.mincap`).

    Attributes:
        lo, hi: the device caps searched, in GB (10^9 B); ``hi`` None: the first trial runs
            uncapped (the device's whole memory); ``lo`` 0: nothing trains in no memory, so
            the bottom is never tried.
        resolution: caps tried are ``lo + k * resolution`` (and ``hi``): the smallest cap is
            found to within this many GB.
    """

    lo: float = 0.0
    hi: float | None = None
    resolution: float = 1.0


@dataclass
class Scenario:
    """Everything one ``xpu bench`` run holds fixed across systems (see the module docstring)."""

    model: dict[str, Any]
    systems: list[SystemEntry]
    name: str = "scenario"
    description: str = ""
    batch: int = 8
    seq: int = 1024
    accumulation_steps: int = 1
    steps: int = 5
    warmup: int = 2
    loss_after: int | None = None
    dtype: str = "auto"
    seed: int = 0
    device_mem_gb: float | None = None
    host_mem_gb: float | None = None
    optimizer: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                               "weight_decay": 0.0})
    timeout_s: float = 1800.0
    timeline: bool = True
    env: dict[str, str] = field(default_factory=dict)
    max_model: MaxModelConfig = field(default_factory=MaxModelConfig)
    min_cap: MinCapConfig = field(default_factory=MinCapConfig)

    # ------------------------------------------------------------------ derived
    @property
    def family(self) -> str:
        """The model family."""
        return self.model["family"]

    def model_dims(self) -> dict[str, Any]:
        """Model dimensions with ``seq`` included (what ``build_model`` takes)."""
        return model_dims(self.model, self.seq)

    def entry(self, label: str) -> SystemEntry:
        """The system entry with this label."""
        for e in self.systems:
            if e.label == label:
                return e
        raise ScenarioError(f"no system labelled {label!r}; labels: {', '.join(e.label for e in self.systems)}")

    def effective(self, entry: SystemEntry) -> dict[str, Any]:
        """steps, warmup, device_mem_gb and total steps for ``entry`` after overrides and period rounding."""
        from .systems import get_system

        steps = self.steps if entry.steps is None else entry.steps
        warmup = self.warmup if entry.warmup is None else entry.warmup
        spec = get_system(entry.name)
        if spec.period_option and isinstance(entry.options.get(spec.period_option), int):
            period = entry.options[spec.period_option]
            steps = period * math.ceil(steps / period)  # whole update intervals, so the mean is fair
        total = max(warmup + steps, self.loss_after or 0)
        cap = None if entry.uncapped else self.device_mem_gb if entry.device_mem_gb is None else entry.device_mem_gb
        return {"steps": steps, "warmup": warmup, "total_steps": total, "device_mem_gb": cap,
                "loss_after": self.loss_after or total}

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str | None = None) -> "Scenario":
        """Build and validate a scenario from a YAML-shaped dict.

        Raises:
            ScenarioError: unknown or bad keys, family, systems or options.
        """
        if not isinstance(data, dict):
            raise ScenarioError(f"a scenario must be a mapping of keys to values, got {type(data).__name__}")
        data = copy.deepcopy(data)
        valid = {f.name for f in fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ScenarioError(f"unknown scenario key(s) {sorted(unknown)}; valid keys: {sorted(valid)}")
        if "model" not in data or "systems" not in data:
            raise ScenarioError("a scenario needs 'model' (family and dimensions) and 'systems' (a list)")
        if not isinstance(data["systems"], list) or not data["systems"]:
            raise ScenarioError("'systems' must be a non-empty list of system names or {name:, options:} mappings")
        data["systems"] = [_entry(s) for s in data["systems"]]
        for key, section in (("max_model", MaxModelConfig), ("min_cap", MinCapConfig)):
            data[key] = _search_section(key, section, data.get(key))
        if name and "name" not in data:
            data["name"] = name
        scenario = cls(**data)
        scenario.validate()
        return scenario

    def to_dict(self) -> dict[str, Any]:
        """A YAML/JSON-friendly dict that :meth:`from_dict` reads back."""
        return asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every value and fill in system option defaults.

        Raises:
            ScenarioError: what is wrong, with the valid values.
        """
        from .systems import discovery_errors, registered_systems

        check_model_section(self.model, self.family, self.model_dims(), ScenarioError)
        for key in ("batch", "seq", "steps"):
            _positive_int(key, getattr(self, key))
        if not isinstance(self.accumulation_steps, int) or isinstance(self.accumulation_steps, bool) \
                or self.accumulation_steps < 1:
            raise ScenarioError(f"accumulation_steps must be a positive integer (micro-batches per optimizer step), "
                                f"got {self.accumulation_steps!r}")
        _nonneg_int("warmup", self.warmup)
        _nonneg_int("seed", self.seed)
        if self.loss_after is not None:
            _positive_int("loss_after", self.loss_after)
        if self.dtype not in _DTYPES:
            raise ScenarioError(f"dtype {self.dtype!r} is not valid; valid: {', '.join(_DTYPES)}")
        for key in ("device_mem_gb", "host_mem_gb"):
            _positive_or_none(key, getattr(self, key))
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ScenarioError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                     for k, v in self.env.items()):
            raise ScenarioError(f"env must map variable names to strings, got {self.env!r}")
        self.env = {k: str(v) for k, v in self.env.items()}
        if not isinstance(self.optimizer, dict) or set(self.optimizer) - _OPT_KEYS:
            raise ScenarioError(f"optimizer takes keys {sorted(_OPT_KEYS)}, got {self.optimizer!r}")
        self.optimizer = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, **self.optimizer}
        mm = self.max_model
        if mm.knob not in KNOBS:
            raise ScenarioError(f"max_model.knob {mm.knob!r} is not valid; valid: {', '.join(KNOBS)}")
        _positive_int("max_model.lo", mm.lo)
        _positive_int("max_model.hi", mm.hi)
        _positive_int("max_model.steps", mm.steps)
        _nonneg_int("max_model.warmup", mm.warmup)
        _positive_int("max_model.resolution", mm.resolution)
        if mm.lo > mm.hi:
            raise ScenarioError(f"max_model.lo ({mm.lo}) must not exceed max_model.hi ({mm.hi})")
        _check_min_cap(self.min_cap)

        systems = registered_systems()
        labels: set[str] = set()
        for entry in self.systems:
            if entry.name not in systems:
                extra = f" (strategy registrations that failed: {'; '.join(discovery_errors())})" if discovery_errors() else ""
                raise ScenarioError(f"unknown system {entry.name!r}; valid systems: {', '.join(systems)}{extra}")
            if entry.label in labels:
                raise ScenarioError(f"system label {entry.label!r} appears twice; give each entry a distinct 'label'")
            labels.add(entry.label)
            spec = systems[entry.name]
            bad = set(entry.options) - set(spec.options)
            if bad:
                valid = ", ".join(sorted(spec.options)) or "none"
                raise ScenarioError(f"system {entry.name!r} has no option(s) {sorted(bad)}; valid options: {valid}")
            entry.options = {**copy.deepcopy(spec.options), **entry.options}
            if self.accumulation_steps > 1 and not spec.accumulation:
                raise ScenarioError(f"system {entry.name!r} does not take accumulation_steps > 1 (got "
                                    f"{self.accumulation_steps}); {spec.accumulation_hint or 'run it with accumulation_steps: 1'}")
            if entry.steps is not None:
                _positive_int(f"{entry.label}.steps", entry.steps)
            if entry.warmup is not None:
                _nonneg_int(f"{entry.label}.warmup", entry.warmup)
            _positive_or_none(f"{entry.label}.device_mem_gb", entry.device_mem_gb)

    def select(self, labels: list[str]) -> "Scenario":
        """A copy keeping only the systems named (by label or by system name), in the order given.

        Raises:
            ScenarioError: a name matches no entry of the scenario nor any registered system.
        """
        from .systems import registered_systems

        picked: list[SystemEntry] = []
        for want in labels:
            matches = [e for e in self.systems if e.label == want] or [e for e in self.systems if e.name == want]
            if not matches:
                if want in registered_systems():
                    matches = [SystemEntry(want)]
                else:
                    raise ScenarioError(
                        f"--systems: {want!r} is neither a label of this scenario "
                        f"({', '.join(e.label for e in self.systems)}) nor a system "
                        f"({', '.join(registered_systems())})")
            picked.extend(m for m in matches if m.label not in {p.label for p in picked})
        out = copy.deepcopy(self)
        out.systems = copy.deepcopy(picked)
        out.validate()
        return out


def _entry(item: Any) -> SystemEntry:
    if isinstance(item, str):
        return SystemEntry(item)
    if isinstance(item, dict):
        valid = {f.name for f in fields(SystemEntry)}
        unknown = set(item) - valid
        if unknown:
            raise ScenarioError(f"unknown key(s) {sorted(unknown)} in system entry {item!r}; valid keys: {sorted(valid)}")
        if "name" not in item:
            raise ScenarioError(f"system entry {item!r} needs a 'name'")
        if not isinstance(item.get("options", {}) or {}, dict):
            raise ScenarioError(f"'options' of system {item['name']!r} must be a mapping")
        # An explicit `device_mem_gb: null` lifts the scenario's cap (a round trip carries `uncapped`).
        uncapped = item.get("uncapped", "device_mem_gb" in item and item["device_mem_gb"] is None)
        if not isinstance(uncapped, bool):
            raise ScenarioError(f"'uncapped' of system {item['name']!r} must be true or false, got {uncapped!r}")
        return SystemEntry(**{**item, "options": dict(item.get("options") or {}), "uncapped": uncapped})
    raise ScenarioError(f"a system entry is a name or a mapping with 'name', got {item!r}")


def _positive_int(key: str, value: Any) -> None:
    positive_int(key, value, ScenarioError)


def _nonneg_int(key: str, value: Any) -> None:
    nonneg_int(key, value, ScenarioError)


def _search_section(key: str, cls: type, value: Any) -> Any:
    """A search's settings (``max_model``, ``min_cap``) as ``cls``; unknown keys named with the valid ones."""
    value = value or {}
    if not isinstance(value, dict):
        raise ScenarioError(f"'{key}' must be a mapping")
    valid = {f.name for f in fields(cls)}
    if set(value) - valid:
        raise ScenarioError(f"unknown {key} key(s) {sorted(set(value) - valid)}; valid: {sorted(valid)}")
    return cls(**value)


def _check_min_cap(mc: MinCapConfig) -> None:
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not number(mc.resolution) or mc.resolution <= 0:
        raise ScenarioError(f"min_cap.resolution (--cap-resolution) must be a positive number of GB, got {mc.resolution!r}")
    if not number(mc.lo) or mc.lo < 0:
        raise ScenarioError(f"min_cap.lo must be a number of GB >= 0, got {mc.lo!r}")
    if mc.hi is not None and (not number(mc.hi) or mc.hi <= mc.lo):
        raise ScenarioError(f"min_cap range {mc.lo}:{mc.hi} is empty or reversed; give LO:HI with 0 <= LO < HI GB "
                            f"(or LO: for an uncapped top)")


def _positive_or_none(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
        raise ScenarioError(f"{key} must be a positive number of GB (or null), got {value!r}")


def resolve_scenario_path(name_or_path: str | Path) -> Path:
    """A YAML path as given, or ``examples/bench/<name>.yaml`` for a bare scenario name.

    Raises:
        ScenarioError: neither exists; the message lists the named scenarios.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    named = EXAMPLES_DIR / f"{name_or_path}.yaml"
    if named.exists():
        return named
    known = sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml")) if EXAMPLES_DIR.exists() else []
    raise ScenarioError(f"no scenario file {str(name_or_path)!r}; named scenarios: {', '.join(known) or 'none'}")


def load_scenario(source: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> Scenario:
    """Load a scenario from a YAML path, a scenario name, or a dict; apply dotted ``overrides``.

    ``overrides`` maps dotted keys to values, e.g. ``{"model.layers": 4, "steps": 3}``.

    Raises:
        ScenarioError: unreadable YAML or an invalid scenario.
    """
    import yaml

    name = None
    if isinstance(source, dict):
        data = copy.deepcopy(source)
    else:
        path = resolve_scenario_path(source)
        name = path.stem
        try:
            data = load_yaml(path.read_text())
        except yaml.YAMLError as exc:
            raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    apply_overrides(data, overrides, ScenarioError)
    return Scenario.from_dict(data, name=name)
