"""Strategies, scaleup and xpu speak to a Backend, never to torch.cuda / torch.npu directly."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BANNED = re.compile(r"torch\.cuda\b|torch\.npu\b|\.cuda\(\)|\.npu\(\)|torch_npu")
CHECKED = ["xpu", "strategies", "scaleup", "examples", "bench"]
#: Diagnostics that exist to probe one device's own API (they name what they test).
EXEMPT = ("bench/scripts/diag_",)


def offending_lines(root: Path = ROOT) -> list[str]:
    hits = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).exists() else []:
            if str(path.relative_to(root)).startswith(EXEMPT):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if BANNED.search(code):
                    hits.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return hits


def test_no_device_module_calls_outside_backends():
    hits = offending_lines()
    assert not hits, "device calls belong in backends/; use xpu.get_backend() instead:\n" + "\n".join(hits)


def test_the_lint_catches_a_violation(tmp_path):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "bad.py").write_text("import torch\nx = torch.zeros(3).cuda()\ny = torch.cuda.Stream()\n")
    hits = offending_lines(tmp_path)
    assert len(hits) == 2 and "bad.py:2" in hits[0]
