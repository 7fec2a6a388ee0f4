"""Shared fixtures: the conformance suite runs once per backend available here.

The cpu reference backend runs everywhere; ``cuda`` runs on the GPU machine under
``pytest -m gpu``; the npu backend is checked against a stand-in torch_npu in
``test_npu_backend.py``.
"""
from __future__ import annotations

import os

import pytest
import torch

import xpu

# Triton reads TRITON_INTERPRET once, when its @jit decorators first run (torch.compile imports
# triton early in a session), so the interpreter is chosen here, before any test: where there
# is no accelerator, xpu.triton_dha's kernels can only run interpreted (test_triton_dha.py).
if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _collector_thawed():
    """An engine a test leaves open would keep what every later test set up frozen out of
    Python's garbage collection (``gc_pauses.py``): thawed after each test."""
    yield
    from strategies.memferry import gc_pauses

    gc_pauses.release_all()


def _backend_params():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=_backend_params())
def backend(request, monkeypatch):
    """A fresh backend of each kind, selected through XPU_BACKEND as a user would."""
    monkeypatch.setenv("XPU_BACKEND", request.param)
    xpu.reset_backend()
    try:
        b = xpu.get_backend()
    except xpu.BackendUnavailableError as exc:
        pytest.skip(str(exc))
    yield b
    for i in range(b.device_count()):
        b.set_memory_cap(i, None)
    xpu.reset_backend()


@pytest.fixture
def cpu_backend(monkeypatch):
    """The cpu reference backend with its default four virtual devices."""
    monkeypatch.setenv("XPU_BACKEND", "cpu")
    xpu.reset_backend()
    yield xpu.get_backend()
    xpu.reset_backend()


@pytest.fixture
def gpu_backend(monkeypatch):
    """The accelerator backend this machine has, auto-detected as a user's would be (skips
    where there is none); device caps lifted afterwards."""
    monkeypatch.delenv("XPU_BACKEND", raising=False)
    xpu.reset_backend()
    b = xpu.get_backend()
    if b.device(0).type == "cpu":
        pytest.skip("no accelerator here")
    yield b
    for i in range(b.device_count()):
        b.set_memory_cap(i, None)
    xpu.reset_backend()
