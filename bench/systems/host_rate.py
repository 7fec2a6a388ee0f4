"""The row fields a MemFerry row reports on its host optimizer: its rate, the plan's, and the
floor host memory sets (``xpu probe``'s triad bandwidth over the bytes each update moves).

Issue 16 asks the host AdamW alone to run within 1.15x of that floor: ``host_over_floor`` of a
``measure: host-optimizer`` row says how far it is; in a training row the ratio also holds the
slowdown the step's own copies cause.
"""
from __future__ import annotations

from typing import Any

import torch

from strategies.memferry.host_budget import update_bytes

__all__ = ["host_metrics", "host_note"]


def host_metrics(measured: float | None, planned: float | None, dtype: torch.dtype, accumulation_steps: int,
                 clip_mode: str, backend: Any, device_summed: float = 0.0, paired: bool = True,
                 split: bool = False) -> dict[str, Any]:
    """Row fields from the engine's ``host_rate()`` (seconds per parameter, measured and planned):

    ``host_ns_per_param`` (None before any update), ``host_planned_ns_per_param`` (None without
    plan ``auto``), ``host_bytes_per_param`` (what those timed updates move per parameter:
    ``host_budget.update_bytes(...).timed``, averaged with ``device_summed``, the share of the
    host-updated parameters whose micro-batches the device sums; ``paired``: the host sums the
    others two at a time, as one process does; ``split``: updates in two passes,
    ``AdamW.split_update``), ``host_triad_GBps`` (the cached
    probe's; None when not probed), ``host_floor_ns_per_param`` (the bytes at that rate) and
    ``host_over_floor``.
    """
    from xpu.probe import load_cached

    on_host, on_device = (update_bytes(dtype.itemsize, accumulation_steps, clip_mode, summed, paired, split=split).timed
                          for summed in (False, True))
    nbytes = round((1 - device_summed) * on_host + device_summed * on_device, 1) if device_summed else on_host
    triad = ((load_cached(backend) or {}).get("host") or {}).get("triad_GBps")
    floor = nbytes / float(triad) if triad else None
    ns = measured * 1e9 if measured else None
    return {"host_ns_per_param": None if ns is None else round(ns, 4),
            "host_planned_ns_per_param": round(planned * 1e9, 4) if planned else None,
            "host_bytes_per_param": nbytes, "host_triad_GBps": triad,
            "host_floor_ns_per_param": None if floor is None else round(floor, 4),
            "host_over_floor": round(ns / floor, 3) if ns and floor else None}


def host_note(m: dict[str, Any]) -> str:
    """``; host AdamW x ns/param (planned y; z x the floor of b B at the probe's t GB/s)`` for a row's notes."""
    if m.get("host_ns_per_param") is None:
        return ""
    extra = [f"planned {m['host_planned_ns_per_param']:.3f}"] if m.get("host_planned_ns_per_param") else []
    if m.get("host_over_floor") is not None:
        extra.append(f"{m['host_over_floor']:.2f}x the {m['host_floor_ns_per_param']:.3f} that "
                     f"{m['host_bytes_per_param']} B take at the probe's triad {m['host_triad_GBps']:.0f} GB/s")
    return f"; host AdamW {m['host_ns_per_param']:.3f} ns/param" + (f" ({'; '.join(extra)})" if extra else "")
