"""Backend selection: XPU_BACKEND, auto-detection, and the errors users see."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import xpu
from xpu import registry


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    xpu.reset_backend()
    yield
    xpu.reset_backend()


def test_bogus_name_lists_valid_backends(monkeypatch):
    monkeypatch.setenv("XPU_BACKEND", "bogus")
    with pytest.raises(xpu.UnknownBackendError, match=r"'bogus' is not a known backend; valid values: cpu, cuda, npu"):
        xpu.get_backend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unusable_backend_says_why(monkeypatch):
    monkeypatch.setenv("XPU_BACKEND", "cuda")
    with pytest.raises(xpu.BackendUnavailableError, match="backend 'cuda' is not usable here: .*(without CUDA|no CUDA device)"):
        xpu.get_backend()


def test_explicit_cpu(monkeypatch):
    monkeypatch.setenv("XPU_BACKEND", " CPU ")
    assert xpu.get_backend().name == "cpu"


def test_autodetect_prefers_priority_and_warns_on_fallback(monkeypatch, caplog):
    monkeypatch.delenv("XPU_BACKEND", raising=False)
    monkeypatch.setattr(registry, "_why_unusable", lambda e: None if e.name == "cpu" else f"{e.name} missing")
    with caplog.at_level(logging.WARNING, logger="xpu"):
        assert xpu.get_backend().name == "cpu"
    assert "no npu or cuda usable; using the 'cpu' backend" in caplog.text
    xpu.reset_backend()
    monkeypatch.setattr(registry, "_why_unusable", lambda e: None if e.name in ("cpu", "cuda") else "missing")
    chosen = []
    monkeypatch.setattr(registry, "_load_class", lambda e: (chosen.append(e.name), lambda: e.name)[1])
    assert xpu.get_backend() == "cuda" and chosen == ["cuda"]


def test_registration_is_one_line_and_lazy(monkeypatch):
    monkeypatch.setattr(registry.BACKENDS, "_plugins", dict(registry.BACKENDS.plugins()))
    xpu.register_backend("toy", "tests.toy_backend_does_not_exist:Toy", priority=-5)
    assert xpu.registered_backends()[-1] == "toy"
    status = xpu.backend_status()
    assert "could not be imported" in status["toy"]
    monkeypatch.setenv("XPU_BACKEND", "toy")
    with pytest.raises(xpu.BackendUnavailableError, match="toy.*could not be imported"):
        xpu.get_backend()


def _cli(*args, env_backend):
    env = {"XPU_BACKEND": env_backend, "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "xpu", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_bogus_backend_exits_nonzero_and_names_valid_ones():
    res = _cli("info", env_backend="bogus")
    assert res.returncode != 0
    assert "valid values: cpu, cuda, npu" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_without_cuda_says_why():
    res = _cli("info", env_backend="cuda")
    assert res.returncode != 0
    assert "not usable here" in res.stderr and "CUDA" in res.stderr


def test_cli_info_json_on_cpu():
    import json

    res = _cli("info", "--json", env_backend="cpu")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["backend"] == "cpu" and len(info["devices"]) == info["device_count"]
    assert info["caps"]["dha"] is True
