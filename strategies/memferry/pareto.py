"""The scheduler's dominance pruning: which partial plans no other one beats in every component.

A partial plan is a row of :meth:`~strategies.memferry.cost.State.key` (times and bytes, each
non-decreasing as blocks are added, the prediction non-decreasing in each), so a row that is
component-wise at least another row can never complete into a better plan and is dropped.

The scan runs in C (``pareto.c``, built once per machine by ``c_library.py``) where a compiler
is there, else in numpy; both keep the same rows. The search for the DESIGN §3 model under
accumulation 8 makes about 1,800 scans of 12-19 thousand rows: 37.3 s in numpy on one core, 11.6 s
in C (bench/results/2026-12-04-cpu-session25/search.md); it took 58 s of the H200 machine's setup.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np

from .c_library import CLibrary, UnavailableError

__all__ = ["pareto_front"]

log = logging.getLogger("xpu.memferry")

#: Rows compared against each other at once (memory: CHUNK x kept booleans per column).
CHUNK = 256
#: Kept rows compared with a chunk at once, the latest first (see :func:`pareto_front`).
SCOUTS = 128


def pareto_front(rows: np.ndarray, cap: int | None) -> tuple[np.ndarray, bool]:
    """Indices of the rows no other row is component-wise at most (ties: the first kept).

    Args:
        rows: one partial plan's state key per row (``-inf`` allowed: "none yet").
        cap: most rows kept (None: all); past it, the rows with the smallest components first.

    Returns:
        The kept rows' indices, in lexicographic order of their rows, and whether ``cap``
        dropped non-dominated ones (then the search is no longer proven optimal).
    """
    if len(rows) <= 1:
        return np.arange(len(rows)), False
    keys = np.where(np.isneginf(rows), -1e300, rows)  # finite, so comparisons stay plain
    # Columns equal in every row decide nothing: compare the others only.
    keys = keys[:, (keys != keys[0]).any(axis=0)]
    if keys.shape[1] == 0:  # every row the same: one stands for all
        return np.arange(1), False
    scan = _c_scan()
    if scan is not None and not np.isnan(keys).any():  # NaN has no place in the C sort's order
        kept = scan(np.ascontiguousarray(keys, dtype=np.float64), cap)
        return kept[:cap] if cap is not None else kept, cap is not None and len(kept) > cap
    # Lexicographic order (stable): a row that dominates another (and differs) sorts before it.
    order = np.lexsort(keys.T[::-1])
    keys = keys[order]
    # In that order a row is dropped when any earlier one is at most it in every component: an
    # earlier dropped one is itself dominated by a kept one, which then dominates this one too
    # (transitivity), so "any earlier" is "any kept earlier". Checked a chunk at a time, one
    # column at a time (no rows x chunk x columns array).
    kept = np.zeros(len(keys), dtype=bool)
    for c0 in range(0, len(keys), CHUNK):
        x = keys[c0:c0 + CHUNK]
        alive = np.ones(len(x), dtype=bool)
        prior = keys[:c0][kept[:c0]]
        # Most dominated rows fall to a kept row near them in the order: the kept rows are met
        # from the last backwards, a block at a time, each block only by the rows still standing.
        for end in range(len(prior), 0, -SCOUTS):
            idx = np.flatnonzero(alive)
            if not len(idx):
                break
            alive[idx[_dominated(prior[max(0, end - SCOUTS):end], x[idx]).any(axis=0)]] = False
        # Within the chunk only rows still standing need dominating others: a dropped one is at
        # least a kept row, which then is at most whatever the dropped one was at most.
        idx = np.flatnonzero(alive)
        y = x[idx]
        alive[idx[np.triu(_dominated(y, y), k=1).any(axis=0)]] = False
        kept[c0:c0 + CHUNK] = alive
        # Past the cap only the first ``cap`` kept rows matter, and whether any other exists:
        # the scan can stop there (the same answer, in far fewer comparisons on large fronts).
        if cap is not None and kept[:c0 + CHUNK].sum() > cap:
            return order[kept][:cap], True
    return order[kept], False


def _dominated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[i, j]``: row ``a[i]`` is at most row ``b[j]`` in every column.

    Column by column over contiguous copies of the columns, into one buffer, stopping once no
    pair is left; the first column last: the callers pass rows in lexicographic order, earlier
    ones as ``a``, so it rarely separates a pair (12 % faster on 200 of the scheduler's fronts
    for the docs/design.md §3 model, the same rows kept)."""
    at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    cols = list(range(1, a.shape[1])) + [0]
    at_most = at[cols[0]][:, None] <= bt[cols[0]][None, :]
    step = np.empty_like(at_most)
    for col in cols[1:]:
        if not at_most.any():
            break
        np.less_equal(at[col][:, None], bt[col][None, :], out=step)
        at_most &= step
    return at_most


def _wrap(path: Path):
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.xpu_pareto_scan.argtypes = [p, i64, i64, i64, p, p]
    lib.xpu_pareto_scan.restype = i64

    def scan(keys: np.ndarray, cap: int | None) -> np.ndarray:
        """Indices of the kept rows of C-contiguous ``keys``, in lexicographic order of their
        rows: at most ``cap + 1`` of them (more than ``cap``: the cap cut)."""
        n, d = keys.shape
        order = np.empty(n, dtype=np.int64)
        kept = np.empty(n if cap is None else min(n, cap + 1), dtype=np.int64)
        nk = lib.xpu_pareto_scan(keys.ctypes.data, n, d, -1 if cap is None else cap, order.ctypes.data,
                                 kept.ctypes.data)
        if nk < 0:
            raise MemoryError(f"the dominance scan could not allocate {n} indices")
        return kept[:nk]

    return scan


_LIBRARY = CLibrary(Path(__file__).with_name("pareto.c"), ["-O3", "-fPIC", "-shared", "-std=gnu11"],
                    [["-march=native"], []], _wrap)
_WARNED = False


def _c_scan():
    """The C scan, or None where it cannot be built (said once in the log; numpy scans instead)."""
    global _WARNED
    try:
        return _LIBRARY.get()
    except UnavailableError as exc:
        if not _WARNED:
            _WARNED = True
            log.info("plan search: the C dominance scan is unavailable (%s); numpy scans, slower", exc)
        return None
