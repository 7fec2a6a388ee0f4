"""The one registry helper (xpu.plugins) that backends, commands, systems and strategies share."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest

import xpu
import xpu.plugins
from xpu.plugins import PluginRegistry, load_target

def _with_entry_points(monkeypatch, group, *pairs):
    found = [EntryPoint(name, value, group) for name, value in pairs]
    monkeypatch.setattr(xpu.plugins, "entry_points", lambda group: [e for e in found if e.group == group])

def test_priority_order_and_lazy_load(tmp_path, monkeypatch):
    (tmp_path / "lazy_mod.py").write_text("LOADED = True\nclass Thing:\n    kind = 'thing'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = PluginRegistry("gadget")
    reg.register("low", "lazy_mod:Thing", priority=-1)
    reg.register("high", "lazy_mod:Thing", priority=5, colour="red")
    reg.register("mid", "lazy_mod:Thing")
    assert "lazy_mod" not in sys.modules  # registering imports nothing
    assert reg.names() == ["high", "mid", "low"]
    assert reg.get("high").meta == {"colour": "red"}
    assert reg.load("mid").kind == "thing"

def test_unknown_name_lists_the_valid_ones():
    reg = PluginRegistry("gadget")
    reg.register("a", "x:y")
    reg.register("b", "x:y")
    with pytest.raises(KeyError, match="unknown gadget 'c'; valid: a, b"):
        reg.get("c")

def test_bad_target_is_refused_at_registration():
    reg = PluginRegistry("gadget")
    with pytest.raises(ValueError, match="'package.module:attribute'"):
        reg.register("a", "no_colon_here")
    with pytest.raises(ValueError, match="'package.module:attribute'"):
        load_target("mod:")

def test_entry_points_register_modules_and_targets(tmp_path, monkeypatch):
    (tmp_path / "owner_mod.py").write_text(textwrap.dedent("""
        from test_plugins_shared import REG
        REG.register("from-module", "owner_mod:VALUE", priority=3)
        VALUE = 42
    """))
    (tmp_path / "test_plugins_shared.py").write_text("from xpu.plugins import PluginRegistry\n"
                                                     "REG = PluginRegistry('gadget', group='test.gadgets')\n")
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _with_entry_points(monkeypatch, "test.gadgets", ("owner", "owner_mod"), ("direct", "owner_mod:VALUE"),
                       ("bad", "broken_mod"))
    from test_plugins_shared import REG

    assert REG.names() == ["from-module", "direct"]
    assert REG.load("from-module") == 42 and REG.get("direct").target == "owner_mod:VALUE"
    (error,) = REG.errors()
    assert "broken_mod" in error and "broken on purpose" in error

def test_no_backend_registered_says_to_install(monkeypatch):
    from xpu import registry

    monkeypatch.setattr(registry, "BACKENDS", PluginRegistry("backend", group="test.none"))
    monkeypatch.setattr(registry, "_active", None)
    monkeypatch.delenv("XPU_BACKEND", raising=False)
    with pytest.raises(xpu.BackendUnavailableError, match="pip install -e"):
        xpu.get_backend()

def test_every_subcommand_is_registered_by_its_owner():
    out = subprocess.run([sys.executable, "-m", "xpu", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ") and line.split()]
    assert listed[:6] == ["info", "probe", "bench", "train", "export", "mpress"]
    assert "failed to register" not in out.stdout
