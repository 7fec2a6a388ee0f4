"""Two of the code rules in the developers' guide, checked: no source file (Python, C) over 500
lines, and no Python file with a pyflakes error (an undefined or unused name, an import shadowed: ``ruff --select F``)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def _sources(patterns: tuple[str, ...] = ("*.py", "*.c", "*.h")) -> list[Path]:
    """The project's source files: git's tracked ones (not a virtual environment inside the tree)."""
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
        files = [ROOT / line for line in out.stdout.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but hidden folders'
        files = [p for pattern in patterns for p in ROOT.rglob(pattern)
                 if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    return sorted(p for p in files if "results" not in p.relative_to(ROOT).parts and p.exists())


def test_no_source_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by job (at most {MAX_LINES} lines a file): {long}"


def _ruff() -> list[str]:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    pytest.importorskip("ruff")  # the test extra installs it; a bare checkout may not have it
    return [sys.executable, "-m", "ruff"]


def test_pyflakes_finds_nothing():
    out = subprocess.run([*_ruff(), "check", "--select", "F", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_pyflakes_check_catches_an_undefined_name(tmp_path):
    (tmp_path / "bad.py").write_text("def f():\n    return undefined_name\n")
    out = subprocess.run([*_ruff(), "check", "--select", "F", "--no-cache", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "F821" in out.stdout
