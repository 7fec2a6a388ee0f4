"""Byte-size parsing and formatting shared by the CLI, configs and backends."""
from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes", "env_bytes", "env_int"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from ``1024``, ``"16GB"``, ``"1.5 GiB"`` or ``"512MiB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024.

    Raises:
        ValueError: the value is negative or not a size; the message lists the units.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _PATTERN.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a byte size; write a number with an optional unit "
                f"(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '16GB' or '512MiB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"a byte size cannot be negative, got {value!r}")
    return int(round(number * _UNITS[unit]))


def format_bytes(nbytes: int | float) -> str:
    """Format a byte count with a decimal unit, e.g. ``17.7 GB``."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"


def env_bytes(name: str, value: str, *, also: str = "") -> int:
    """``parse_bytes(value)`` for the environment variable ``name``.

    Raises:
        xpu.errors.EnvSettingError: the value is not a size; the one-line message names the
            variable and its value (``also`` adds what else the variable accepts).
    """
    try:
        return parse_bytes(value)
    except ValueError:
        from .errors import EnvSettingError  # lazy: this module stays free of torch

        raise EnvSettingError(f"{name}={value!r} is not a size; give bytes or a size such as 2GB{also}") from None


def env_int(name: str, value: str, *, least: int | None = None) -> int:
    """``int(value)`` for the environment variable ``name``, at least ``least`` if given.

    Raises:
        xpu.errors.EnvSettingError: the value is not a whole number (or is below ``least``).
    """
    from .errors import EnvSettingError

    try:
        number = int(value.strip())
    except ValueError:
        raise EnvSettingError(f"{name}={value!r} is not a whole number; give one such as 4") from None
    if least is not None and number < least:
        raise EnvSettingError(f"{name}={value!r} must be at least {least}")
    return number
