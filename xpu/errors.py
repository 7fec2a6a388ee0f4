"""Exceptions raised by the xpu layer.

Each one says what was wrong and what would work; strategies catch them by type, never by
message.
"""
from __future__ import annotations

import torch

__all__ = [
    "XpuError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "CapabilityError",
    "HostMemoryBudgetError",
    "EnvSettingError",
    "DeviceOutOfMemoryError",
    "CollectiveTimeoutError",
]


class XpuError(RuntimeError):
    """Base class of every error raised by the xpu layer."""


class UnknownBackendError(XpuError, ValueError):
    """A backend name (usually from ``XPU_BACKEND``) that no registered backend has."""


class BackendUnavailableError(XpuError):
    """A known backend that cannot run in this process; the message says why."""


class CapabilityError(XpuError, NotImplementedError):
    """A verb the backend does not support here (for example ``device_view`` without DHA)."""


class HostMemoryBudgetError(XpuError, MemoryError):
    """A pinned-host allocation that would exceed the arena's host-memory budget."""


class EnvSettingError(XpuError, ValueError):
    """An environment variable (``XPU_CPU_DEVICES``, ``XPU_HOST_MEM_BUDGET``, ...) whose value
    cannot be read; the message names the variable, its value and what would work.

    It is a ``ValueError`` too, so callers that caught the parse error before still do."""


class CollectiveTimeoutError(XpuError):
    """A collective or send/recv of our own process groups did not complete within its bound
    (``XPU_COLLECTIVE_TIMEOUT_S``): a peer rank or pipeline stage stopped, died or lagged. The
    message names this rank and the ones it was waiting for."""


#: Out-of-memory on a device. It *is* ``torch.OutOfMemoryError`` (the type torch.cuda and
#: torch_npu raise), so code that handles a real device's OOM handles a virtual one's too.
DeviceOutOfMemoryError = torch.OutOfMemoryError
