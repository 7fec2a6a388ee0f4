"""The layers point one way, and only backends know backends by name.

    xpu  <-  backends  <-  scaleup  <-  strategies  <-  bench  <-  the command line

(docs/design.md, "Layer map"). Each module may import its own layer and the layers below it,
never one above, not even lazily: by ``importlib.import_module("...")`` or a
``"package.module:attr"`` target string. The command line is not a package: each owner
registers its own ``xpu`` subcommand through the ``xpu.commands`` entry point.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Bottom to top; written once here.
LAYERS = ["xpu", "backends", "scaleup", "strategies", "bench"]
RANK = {name: i for i, name in enumerate(LAYERS)}
_TARGET = re.compile(r"^(%s)(\.\w+)*(:[\w.]+)?$" % "|".join(LAYERS))
#: Where a backend's name or a device type may be compared with a literal.
NAME_AWARE = ("xpu", "backends")
#: CUDA-only diagnoses, exempt from the torch.cuda lint as well (test_no_device_calls_outside_backends).
DIAGNOSES = "bench/scripts/diag_"
_DEVICE_NAMES = {"cpu", "cuda", "npu"}


def _modules():
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if "results" in path.relative_to(ROOT).parts:
                continue
            yield layer, path


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module or target) for every import, import_module call and target string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _TARGET.match(node.value):
            if ":" in node.value or "." in node.value:  # a lazy target or a module path by string
                found.append((node.lineno, node.value.partition(":")[0]))
    return found


def test_no_module_imports_from_a_layer_above_it():
    bad = []
    for layer, path in _modules():
        for line, target in _imports(path):
            top = target.split(".")[0]
            if top in RANK and RANK[top] > RANK[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {target} ({top})")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_the_layer_test_catches_an_upward_import():
    probe = ROOT / "xpu" / "_layering_probe.py"
    probe.write_text('import importlib\nX = importlib.import_module("bench.report")\nT = "strategies.memferry:MemFerry"\n')
    try:
        with pytest.raises(AssertionError, match=r"xpu/_layering_probe.py:2 \(xpu\) imports bench.report"):
            test_no_module_imports_from_a_layer_above_it()
    finally:
        probe.unlink()


def _literal_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literal_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _name_comparisons(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(isinstance(o, ast.Attribute) and o.attr in ("name", "type", "device_type") for o in operands)
        literal = set().union(*(_literal_names(o) for o in operands)) & _DEVICE_NAMES
        if named and literal:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out.append(f"{shown}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_only_backends_and_xpu_compare_backend_names_or_device_types():
    bad = [hit for layer, path in _modules()
           if layer not in NAME_AWARE and not str(path.relative_to(ROOT)).startswith(DIAGNOSES)
           for hit in _name_comparisons(path)]
    assert not bad, ("compare capabilities (backend.caps) or ask xpu (xpu.in_host_memory) instead of names:\n"
                     + "\n".join(bad))


def test_the_name_test_catches_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(backend, t):\n    return backend.name == "cpu" or t.device.type in ("cuda", "npu")\n')
    assert len(_name_comparisons(probe)) == 2
