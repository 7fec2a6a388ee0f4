"""Checks and overrides shared by every YAML config of the project: ``xpu train``, ``xpu mpress`` and ``xpu bench`` scenarios.

Each check raises the caller's own error type (a ``ValueError`` subclass), so every message a
user sees names the file kind it came from.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

__all__ = ["positive_int", "nonneg_int", "positive_number", "model_dims", "check_model_section", "apply_overrides",
           "parse_set_items", "read_config_source", "load_yaml"]

_LOADER: Any = None


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, except that unquoted ``1e-3``, ``3E-4`` and ``.5`` are floats.

    PyYAML follows YAML 1.1, whose float pattern wants a dot and a signed exponent, so it reads
    ``lr: 1e-3`` as the *string* ``'1e-3'`` (and then "must be a positive number, got '1e-3'").
    This loader adds YAML 1.2's float pattern; a quoted ``'1e-3'`` stays a string.
    """
    global _LOADER
    import re

    import yaml

    if _LOADER is None:
        class _Loader(yaml.SafeLoader):
            """SafeLoader with YAML 1.2 floats (``1e-3``)."""

        _Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$"),
            list("-+0123456789."))
        _LOADER = _Loader
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a SafeLoader subclass


def read_config_source(source: "str | Path | dict[str, Any]", error: type[Exception] = ValueError) -> tuple[Any, Path | None]:
    """A config's data from a YAML path (and that path) or from a dict (a deep copy; path None).

    Raises ``error`` for a missing file or YAML that does not parse; what the data holds is the
    caller's to check.
    """
    if isinstance(source, dict):
        return copy.deepcopy(source), None
    import yaml

    path = Path(source)
    if not path.is_file():
        raise error(f"no config file {str(source)!r}")
    try:
        return load_yaml(path.read_text()), path
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def positive_int(key: str, value: Any, error: type[Exception] = ValueError) -> None:
    """``value`` must be an int >= 1 (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{key} must be a positive integer, got {value!r}")


def nonneg_int(key: str, value: Any, error: type[Exception] = ValueError) -> None:
    """``value`` must be an int >= 0 (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise error(f"{key} must be a non-negative integer, got {value!r}")


def positive_number(key: str, value: Any, error: type[Exception] = ValueError) -> None:
    """``value`` must be an int or float > 0 (bools refused)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise error(f"{key} must be a positive number, got {value!r}")


def model_dims(model: dict[str, Any], seq: int) -> dict[str, Any]:
    """A ``model:`` section's dimensions: without ``family``, ``seq`` defaulting to the run's
    (what :func:`strategies.models.build_model` takes)."""
    dims = {k: v for k, v in model.items() if k != "family"}
    dims.setdefault("seq", seq)
    return dims


def check_model_section(model: Any, family: str, dims: dict[str, Any], error: type[Exception] = ValueError) -> None:
    """The ``model:`` mapping names a known family with valid dimensions (see :mod:`strategies.models`)."""
    from strategies.models import validate_dims

    if not isinstance(model, dict) or "family" not in model:
        raise error("'model' must be a mapping with a 'family' (gpt, llama or hf) and its dimensions")
    try:
        validate_dims(family, dims)
    except ValueError as exc:
        raise error(f"model: {exc}") from None


def apply_overrides(data: Any, overrides: dict[str, Any] | None, error: type[Exception] = ValueError,
                    promote: dict[str, str] | None = None) -> None:
    """Set dotted keys (``{"model.layers": 4}``) in a loaded YAML mapping, in place.

    Missing or null intermediate mappings are created (``checkpoint: null`` then
    ``checkpoint.dir=...``); ``promote`` turns a bare string at a key into a mapping under the
    given field first (``{"strategy": "name"}``: ``strategy: memferry`` becomes
    ``{name: memferry}`` so ``strategy.options.plan=`` can be set).
    """
    for dotted, value in (overrides or {}).items():
        if not isinstance(data, dict):
            return
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if promote and part in promote and isinstance(node.get(part), str):
                node[part] = {promote[part]: node[part]}
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise error(f"cannot set {dotted!r}: {part!r} is not a mapping")
        node[parts[-1]] = value


def parse_set_items(items: list[str] | None, error: type[Exception] = ValueError) -> dict[str, Any]:
    """``["model.layers=2", "steps=3"]`` (a CLI's repeated ``--set``) -> dotted overrides, values read as YAML."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise error(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = load_yaml(value)
        except yaml.YAMLError:
            raise error(f"--set {item!r}: the value is not valid YAML") from None
    return out
