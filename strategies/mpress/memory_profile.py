"""The memory profile of a pipeline stage: what one profiled iteration measured, the planner's input.

Per stage (:class:`StageProfile`): each block's saved-activation bytes per micro-batch, its
input bytes (what recomputation still keeps), forward and backward times, the gap between its
forward and backward (:class:`BlockProfile`); the number of micro-batches in flight at the
stage's peak, and the stage's peak with every block kept (measured, or estimated for a stage
profiled with every block host-swapped because it does not fit its device all kept:
:attr:`StageProfile.mode`).

Each profile also carries every saved tensor of the profiled iteration
(:class:`~strategies.mpress.executor.TensorRecord`: size, producer, consumer, when it was saved
and read), its device's budget and spare memory under it. :func:`summarize_saved` and
:func:`format_profile` condense them (tensors, bytes, top producers by bytes, median
lifetime); :func:`dump_profiles` / :func:`load_profiles` write and read them all as JSON
(``xpu mpress CONFIG --profile-json PATH``). :mod:`strategies.mpress.profiling` takes them.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from xpu.units import format_bytes

from .executor import TensorRecord

__all__ = ["BlockProfile", "StageProfile", "summarize_saved", "format_profile", "dump_profiles", "load_profiles",
           "PROFILE_FORMAT"]

#: The ``format`` tag of :func:`dump_profiles` files.
PROFILE_FORMAT = "mpress-profile/1"


@dataclass(frozen=True)
class BlockProfile:
    """One block as profiled (per micro-batch; averages over the profiled micro-batches).

    Attributes:
        index: global block index.
        saved_bytes: bytes of saved activations (parameters excluded).
        tensors: number of saved tensors counted in ``saved_bytes``.
        input_bytes: bytes of the block's input (kept by recomputation).
        fwd_s: forward time; recomputation costs this again.
        bwd_s: backward time.
        gap_s: time from the end of its forward to the start of its backward.
    """

    index: int
    saved_bytes: int
    tensors: int
    input_bytes: int
    fwd_s: float
    bwd_s: float
    gap_s: float


@dataclass(frozen=True)
class StageProfile:
    """One stage as profiled.

    Attributes:
        stage: stage index.
        device: device index it ran on.
        blocks: its blocks in forward order.
        peak_bytes: peak device memory of the iteration with every block kept: measured when
            ``mode`` is ``"keep"``; with ``"host"``, the measured peak plus the saved bytes of
            the micro-batches in flight (what keeping them would have added; an estimate that
            errs high, by about one block's backward transient).
        inflight: most micro-batches whose activations were alive at once.
        microbatches: micro-batches per iteration.
        mode: how the profiled iteration ran: ``"keep"`` (every block kept) or ``"host"``
            (every block host-swapped, for stages that do not fit their device all kept).
        measured_peak_bytes: the peak the profiled iteration really reached (None: ``peak_bytes``).
        saved: every saved tensor of the profiled iteration's micro-batches, ordered by
            micro-batch, block and save order (empty when tensors were not traced).
        budget_bytes: the device's budget (the job's, else the device's capacity); None: unknown.
        clock_s: ``time.perf_counter()`` at the iteration's start, the zero of the tensor times
            (one clock for every process of a host: add it to compare stages).
    """

    stage: int
    device: int
    blocks: tuple[BlockProfile, ...]
    peak_bytes: int
    inflight: int
    microbatches: int
    mode: str = "keep"
    measured_peak_bytes: int | None = None
    saved: tuple[TensorRecord, ...] = ()
    budget_bytes: int | None = None
    clock_s: float = 0.0

    @property
    def measured_peak(self) -> int:
        """The peak the profiled iteration really reached."""
        return self.peak_bytes if self.measured_peak_bytes is None else self.measured_peak_bytes

    @property
    def spare_bytes(self) -> int | None:
        """The device's spare memory under its budget with every block kept (budget - ``peak_bytes``;
        negative: over budget); None without a budget."""
        return None if self.budget_bytes is None else self.budget_bytes - self.peak_bytes

    def summary(self, top: int = 3) -> dict[str, Any]:
        """:func:`summarize_saved` of :attr:`saved`, plus the peaks, budget and spare memory."""
        return {"peak_bytes": self.peak_bytes, "measured_peak_bytes": self.measured_peak,
                "budget_bytes": self.budget_bytes, "spare_bytes": self.spare_bytes, **summarize_saved(self.saved, top)}

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict of every field (tensor records included) plus a ``summary``."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("blocks", "saved")}
        out["blocks"] = [asdict(b) for b in self.blocks]
        out["saved"] = [asdict(t) for t in self.saved]
        out["summary"] = self.summary()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StageProfile":
        """Inverse of :meth:`to_dict` (``summary`` is derived, so ignored)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["blocks"] = tuple(BlockProfile(**b) for b in data.get("blocks", ()))
        kwargs["saved"] = tuple(TensorRecord(**{**t, "shape": tuple(t["shape"])}) for t in data.get("saved", ()))
        return cls(**kwargs)


def summarize_saved(records: "tuple[TensorRecord, ...] | list[TensorRecord]", top: int = 3) -> dict[str, Any]:
    """What a stage's saved tensors add up to, over the whole profiled iteration.

    Returns ``tensors`` (records), ``bytes`` (their sum: a tensor saved by two ops counts
    twice, as in :attr:`BlockProfile.saved_bytes`), ``microbatches``, ``top_producers``
    (``[producer, bytes]`` by bytes, largest first, at most ``top``) and the median and
    largest ``lifetime_s`` (None when no tensor was read back).
    """
    by_producer: dict[str, int] = {}
    for r in records:
        by_producer[r.producer] = by_producer.get(r.producer, 0) + r.nbytes
    lifetimes = [r.lifetime_s for r in records if r.lifetime_s is not None]
    ranked = sorted(by_producer.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return {"tensors": len(records), "bytes": sum(r.nbytes for r in records),
            "microbatches": len({r.microbatch for r in records}),
            "top_producers": [[name, nbytes] for name, nbytes in ranked],
            "lifetime_median_s": statistics.median(lifetimes) if lifetimes else None,
            "lifetime_max_s": max(lifetimes) if lifetimes else None}


def format_profile(profile: StageProfile, top: int = 3) -> str:
    """One line per stage: peaks, budget and spare memory, then its saved tensors in short."""
    peak = f"peak {format_bytes(profile.measured_peak)} measured"
    if profile.mode != "keep":
        peak += f" (~{format_bytes(profile.peak_bytes)} all kept)"
    if profile.budget_bytes is not None:
        spare = profile.spare_bytes
        peak += (f", budget {format_bytes(profile.budget_bytes)}, spare "
                 + (format_bytes(spare) if spare >= 0 else f"-{format_bytes(-spare)} (over)"))
    line = f"stage {profile.stage} (device {profile.device}, profiled {profile.mode}): {peak}"
    s = summarize_saved(profile.saved, top)
    if not s["tensors"]:
        return line
    total = s["bytes"] or 1
    producers = ", ".join(f"{name} {format_bytes(b)} ({100 * b / total:.0f}%)" for name, b in s["top_producers"])
    life = ""
    if s["lifetime_median_s"] is not None:
        life = f"; lifetime median {s['lifetime_median_s'] * 1e3:.2f} ms, max {s['lifetime_max_s'] * 1e3:.2f} ms"
    return (f"{line}; saved {s['tensors']} tensors, {format_bytes(s['bytes'])} over {s['microbatches']} "
            f"micro-batches; top producers {producers}{life}")


def dump_profiles(profiles: "list[StageProfile | None]", path: "str | Path", **meta: Any) -> Path:
    """Write every stage's profile, tensor records included, as one JSON file; returns its path.

    ``meta`` (JSON-ready) is stored alongside, e.g. the config name and schedule. Stages
    without a profile are left out. :func:`load_profiles` reads it back.
    """
    path = Path(path)
    doc = {"format": PROFILE_FORMAT, **meta, "stages": [p.to_dict() for p in profiles if p is not None]}
    path.write_text(json.dumps(doc, indent=1))
    return path


def load_profiles(path: "str | Path") -> list[StageProfile]:
    """The stage profiles a :func:`dump_profiles` file holds.

    Raises:
        ValueError: the file is not such a dump.
    """
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not an MPress profile dump (format {PROFILE_FORMAT!r})")
    return [StageProfile.from_dict(d) for d in doc["stages"]]
