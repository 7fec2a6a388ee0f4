"""How much pinned host memory a shadow model takes, worked out before any of it is allocated.

:class:`~.shadow.ShadowModel` checks :func:`host_bytes_needed` against the host's room before
it pins a byte, and sizes speculative clipping's backup arena by :func:`backup_elements`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .units import Unit

if TYPE_CHECKING:
    from .data_parallel import DataParallel

__all__ = ["train_part", "splits", "backup_elements", "host_bytes_needed"]


def train_part(shard: slice, train_numel: int) -> slice:
    """The trainable part of a rank's ``shard`` of a flat unit whose first ``train_numel``
    elements train (empty for a rank whose shard holds only frozen parameters or padding)."""
    return slice(min(shard.start, train_numel), min(shard.stop, train_numel))


def splits(unit: Unit) -> bool:
    """Whether ``unit``'s updates split under ``AdamW.split_update`` (``split_update.py``): its
    compute is 16-bit (an fp32 master is the working copy itself, so there is nothing to write first)."""
    return bool(unit.params) and unit.params[0][1].element_size() < 4


def backup_elements(units: list[Unit], device_homes: set[int] | frozenset, dp: "DataParallel | None" = None,
                    budget: int | None = 0, split: bool = False) -> int:
    """fp32 elements of the speculative-clipping backup arena (``AdamW.clip_mode``): room for the
    master and two moments (12 bytes per parameter) of every host-updated shard, capped at
    ``budget`` bytes (None: uncapped; 0: no speculation). ``split``: 16-bit units split their
    updates, whose first pass speculates without changing state (``split_update.py``): none."""
    total = 0
    for u in units:
        if u.index in device_homes or not u.params or (split and splits(u)):
            continue
        shard = dp.shard(u.numel)[1] if dp is not None else slice(0, u.train_numel)
        shard = train_part(shard, u.train_numel)
        total += 3 * (shard.stop - shard.start)
    return total if budget is None else min(total, budget // 4)


def host_bytes_needed(units: list[Unit], device_homes: set[int] | frozenset, dp: "DataParallel | None" = None,
                      accumulate: bool = False, backup_budget: int | None = 0, paired: frozenset[int] = frozenset(),
                      split: bool = False) -> int:
    """Pinned host bytes :class:`ShadowModel` will take for ``units`` (checked before allocating).

    Per host-homed unit: the compute-dtype working copy of all parameters (whole, padded under
    data parallelism), and for the trainable ones the gradient landing zone, the fp32 master and
    two moments (this rank's shard); an fp32 unit's master is its working copy. Frozen
    parameters take only their working copy (2 bytes each in bf16, 4 in fp32). With ``accumulate`` (gradient accumulation), an
    fp32 sum of the micro-batches' gradients per shard too. With ``backup_budget`` (speculative
    clipping: 0 none, None uncapped), the backup arena of :func:`backup_elements`. Units in
    ``paired`` take a second landing zone. With ``split`` (and ``accumulate``), a 16-bit unit
    keeps its step's fp32 gradient between the two passes of a split update too.
    """
    total = 4 * backup_elements(units, device_homes, dp, backup_budget, split and accumulate)
    for u in units:
        if u.index in device_homes or not u.params:
            continue
        elem = u.params[0][1].element_size()
        padded, shard = dp.shard(u.numel) if dp is not None else (u.numel, slice(0, u.train_numel))
        shard = train_part(shard, u.train_numel)
        size = shard.stop - shard.start
        total += padded * elem + size * elem + 4 * size * (2 if elem == 4 else 3) + (4 * size if accumulate else 0)
        total += size * elem if u.index in paired else 0
        total += 4 * size if split and accumulate and splits(u) else 0
    return total
