"""A C source built once per machine into a shared library, cached, and loaded through ``ctypes``.

For loops that must not hold the GIL (the host optimizer's, ``host_loops.py``) or that numpy runs
as thousands of small-array calls (the plan search's dominance scan, ``pareto.py``). Built with
the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) under the first of a list of
flag sets that compiles, cached under ``$XPU_CACHE_DIR`` (default ``~/.cache/xpu``) keyed by the
source (with the local headers it includes), compiler, flags and CPU (``-march=native`` code runs
only on the CPU it was built for), and loaded once per process. Where no compiler works,
:class:`UnavailableError` says why, and is remembered: callers fall back to torch or numpy.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

__all__ = ["CLibrary", "UnavailableError", "compiler", "source_text", "build"]

T = TypeVar("T")


class UnavailableError(RuntimeError):
    """The library cannot be built or loaded here (no C compiler, or it failed)."""


def compiler() -> str:
    """The C compiler to build with: ``$CC``, else the first of cc, gcc, clang on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise UnavailableError("no C compiler found (set CC, or install gcc)")


def _cpu_key() -> str:
    # A shared home directory seen by different machines must not share a -march=native build.
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XPU_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                           "xpu")
    return Path(root) / "c-library"


def source_text(source: Path) -> str:
    """``source`` and every local header it includes (``#include "name"``, beside it, recursively):
    what a build's cache key must cover, so that editing a header builds again."""
    seen: set[Path] = set()

    def read(path: Path) -> str:
        seen.add(path)
        text = path.read_text()
        parts = [text]
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE):
            header = path.parent / name
            if header not in seen and header.exists():
                parts.append(read(header))
        return "\0".join(parts)

    return read(source)


def build(source: Path, flags: Sequence[str], attempts: Sequence[Sequence[str]], libs: Sequence[str] = ()) -> Path:
    """The shared library of ``source`` built with ``flags`` plus the first of ``attempts`` that
    compiles (cached by :func:`source_text`, the compiler, the flags and the CPU: a build already
    there is reused). Raises :class:`UnavailableError`."""
    cc = compiler()
    text = source_text(source)
    errors = []
    for extra in attempts:
        all_flags = [*flags, *extra]
        key = hashlib.sha256("\0".join([text, cc, *all_flags, platform.machine(), _cpu_key()]).encode()).hexdigest()[:20]
        out = _cache_dir() / f"{source.stem}-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *all_flags, str(source), "-o", tmp, *libs], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode == 0:
                os.replace(tmp, out)  # atomic: a concurrent build by another process is the same bytes
                return out
            last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
            errors.append(f"{cc} {' '.join(extra) or '(portable)'}: {last}")
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{cc}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise UnavailableError(f"could not build {source.name}: " + "; ".join(errors))


class CLibrary(Generic[T]):
    """One C source, built on first :meth:`get` and shared by the process.

    Args:
        source: the C file.
        flags: compiler flags every build takes.
        attempts: extra flags tried in turn (the first that compiles is kept).
        wrap: makes the caller's object from the built library's path (loads it with ctypes).
        libs: libraries to link (``-lm``).
    """

    def __init__(self, source: Path, flags: Sequence[str], attempts: Sequence[Sequence[str]],
                 wrap: Callable[[Path], T], libs: Sequence[str] = ()) -> None:
        self.source, self.flags, self.attempts, self.wrap, self.libs = source, list(flags), attempts, wrap, list(libs)
        self._loaded: T | None = None
        self._failed: str | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        """The loaded library; raises :class:`UnavailableError` (remembering why) where it cannot
        be built or loaded."""
        with self._lock:
            if self._loaded is None:
                if self._failed is not None:
                    raise UnavailableError(self._failed)
                try:
                    self._loaded = self.wrap(build(self.source, self.flags, self.attempts, self.libs))
                except (UnavailableError, OSError) as exc:
                    self._failed = str(exc)
                    raise UnavailableError(self._failed) from exc
            return self._loaded

    def clear(self) -> None:
        """Forget the loaded library and any remembered failure (tests that simulate another machine)."""
        with self._lock:
            self._loaded, self._failed = None, None
