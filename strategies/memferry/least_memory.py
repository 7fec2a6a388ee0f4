"""The plan of least device memory: the smallest budget any plan fits, and a plan that fits it.

The scheduler's search (``scheduler.py``) minimises time, and to stay fast it may decide
consecutive blocks together (long models) and keep a bounded number of partial plans per
block; either can leave it with no fitting plan where one exists. This search weighs memory
alone, block by block, every block free: the memory columns of :func:`~.cost.advance`
(:func:`~.cost.memory_rows`: ``mem``, ``excess``, ``r``, ``pend``, each non-decreasing in every
one of them, and the prefetch slots ``nslot``) go from the last block down over every choice,
keeping the Pareto front, for each prefetch depth and largest prefetch slot allowed; the least
peak of the last front is the least of the plans with that slot, and the least over the slots
the answer. Partial plans that cannot beat the best uniform plan even with the leanest
completion are dropped, which loses no optimum. So :func:`least_memory` is exact for the cost
model while its fronts stay under :data:`FRONT_CAP` rows, and the plan it returns is predicted
(:func:`~.cost.predict`) to peak at exactly the budget it names. :func:`loss_slicing_hint` asks
the same with the loss in more slices, for the message of a budget no plan fits.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from xpu.units import format_bytes

from .config import Plan, UnitPlan
from .cost import Links, OptionCost, memory_rows, option_cost, slot_count
from .memory_terms import loss_peak_estimate, peak_bytes
from .pareto import pareto_front

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["least_memory", "peak_rows", "block_options", "with_loss_chunks", "loss_slicing_hint"]


def peak_rows(profile: "StepProfile", rest_optimizer: str, depth: int, mem: np.ndarray, excess: np.ndarray,
              slot: np.ndarray, margin: float, end_held: np.ndarray, nslot: np.ndarray) -> np.ndarray:
    """Predicted peaks, margin included, of partial plans whose blocks add up to ``mem``,
    ``excess``, ``slot``, ``end_held`` (``cost.State``'s ``r``) and ``nslot``, one per row: what
    ``cost.finish`` predicts (:func:`~.memory_terms.peak_bytes`, the same expression)."""
    return np.floor(peak_bytes(profile, rest_optimizer, depth, mem, excess, slot, end_held, nslot) * (1 + margin))


def block_options(profile: "StepProfile", links: Links, choices: Sequence[UnitPlan],
                  depth: int) -> list[list[OptionCost]]:
    """Each block's :func:`~.cost.option_cost` under each of ``choices`` (``[block][choice]``)."""
    return [[option_cost(profile, links, i, u, depth) for u in choices] for i in range(len(profile.blocks))]


def least_memory(profile: "StepProfile", links: Links, choices: Sequence[UnitPlan],
                 rest_optimizers: Iterable[str] = ("host", "device"), depths: Iterable[int] = (1, 2),
                 margin: float = 0.10) -> tuple[int, Plan]:
    """The smallest device budget (bytes) some plan over ``choices`` fits by the cost model, and
    that plan (see the module for why it is exact).

    Raises:
        ValueError: some block can take none of ``choices`` (each priced at an infinite time).
    """
    rest_optimizers = list(rest_optimizers)
    cases = []  # (depth, the choices each block may take under one largest slot, their peaks)
    for depth in depths:
        opts = block_options(profile, links, choices, depth)
        usable = [[c for c, o in enumerate(row) if math.isfinite(o.a) and math.isfinite(o.b)] for row in opts]
        for slot_cap in sorted({opts[s][c].slot for s, row in enumerate(usable) for c in row}):
            fitting = [[c for c in ok if row[c].slot <= slot_cap] for row, ok in zip(opts, usable)]
            if all(fitting):
                cases.append((depth, opts, fitting, _peaks_fn(profile, rest_optimizers, depth, slot_cap, margin)))
    # A plan in hand (the best uniform one over every case) bounds the search: partial plans that
    # cannot beat it even with the leanest completion are dropped (exact: only those above it).
    best = min((_uniform_peak(opts, fitting, peaks, depth) for depth, opts, fitting, peaks in cases), default=math.inf)
    found = None
    for depth, opts, fitting, peaks in cases:
        rows, layers = _descend(opts, fitting, lambda rows: peaks(rows)[0] <= best, depth)
        if len(rows):
            p, where = peaks(rows)
            j = int(np.argmin(p))
            if found is None or p[j] < best:
                best, found = float(p[j]), (depth, rest_optimizers[int(where[j])], layers, j)
    if found is None:
        raise ValueError(f"no plan over these choices exists: some block can take none of {list(choices)}")
    depth, rest_optimizer, layers, j = found
    picks = []
    for chosen, parent in reversed(layers):  # block 0's layer is the last: the search went down
        picks.append(choices[int(chosen[j])])
        j = int(parent[j])
    return int(math.ceil(best)), Plan(picks, depth, rest_optimizer)


def with_loss_chunks(profile: "StepProfile", chunks: int) -> "StepProfile":
    """``profile`` with its loss in ``chunks`` token slices: the measured loss peak scaled by what
    the shape-based :func:`~.memory_terms.loss_peak_estimate` gives for ``chunks`` against its
    own ``loss_chunks`` (the estimate is an upper bound of the measured by 5-50 %, by a similar
    share at every count, so its ratio carries over where its difference would undershoot)."""
    def estimate(n: int) -> int:
        return loss_peak_estimate(profile.tokens, profile.vocab, profile.hidden, n, profile.dtype_bytes)

    peak = profile.loss_peak_bytes * estimate(chunks) / estimate(profile.loss_chunks)
    return replace(profile, loss_peak_bytes=int(math.ceil(peak)), loss_chunks=chunks)


def loss_slicing_hint(profile: "StepProfile", links: Links, choices: Sequence[UnitPlan], rest_optimizers: Iterable[str],
                      depths: Iterable[int], margin: float, budget: float) -> str:
    """A clause for the no-fit message where slicing the loss (``loss_chunks``) lets the smallest
    plan fit ``budget``: the fewest slices, doubling, that do (:func:`with_loss_chunks`, then
    :func:`least_memory`); nothing where no count does (the peak then lies elsewhere: a block's
    backward, the step's end) or the profile does not know the head's shapes."""
    now, tokens = profile.loss_chunks, profile.tokens
    if not (profile.vocab and profile.hidden) or now >= tokens:
        return ""
    rest_optimizers, depths = list(rest_optimizers), list(depths)

    @functools.cache  # the fewest-slices loop may end at ``tokens``, searched first
    def need(chunks: int) -> int:
        return least_memory(with_loss_chunks(profile, chunks), links, choices, rest_optimizers, depths, margin)[0]

    if need(tokens) > budget:
        return ""
    chunks = now
    while chunks < tokens:
        chunks = min(2 * chunks, tokens)
        if (fits := need(chunks)) <= budget:
            break
    return (f", or slice the loss: at loss_chunks {chunks} the smallest plan needs about {format_bytes(fits)} "
            f"(strategy.options.loss_chunks; in Python the model's loss_chunks, or slice_hf_loss(model, chunks) "
            f"for a transformers model)")


def _peaks_fn(profile: "StepProfile", rest_optimizers: list[str], depth: int, slot: float,
              margin: float) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Rows of memory columns -> each row's least peak over the places of ``rest``'s update, and
    that place's index in ``rest_optimizers``."""
    def peaks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        each = [peak_rows(profile, r, depth, rows[:, 0], rows[:, 1], np.full(len(rows), slot), margin, rows[:, 2],
                          rows[:, 4]) for r in rest_optimizers]
        return np.min(each, axis=0), np.argmin(each, axis=0)
    return peaks


def _uniform_peak(opts: list[list[OptionCost]], fitting: list[list[int]],
                  peaks: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], depth: int) -> float:
    """The least peak of the plans whose blocks all take one choice (of those every block can take)."""
    best = math.inf
    for c in set.intersection(*(set(f) for f in fitting)):
        rows = np.array([START])
        for row in reversed(opts):
            rows = _grown(rows, row[c], depth)
        best = min(best, float(peaks(rows)[0][0]))
    return best


def _grown(rows: np.ndarray, cur: OptionCost, depth: int) -> np.ndarray:
    """``rows`` (the columns of :data:`START`) with block ``cur`` added below."""
    return np.concatenate([memory_rows(rows[:, :4], cur), slot_count(rows[:, 4], cur, depth)[:, None]], axis=1)


#: Most rows kept per block. Blocks of a few kinds keep fronts of tens of rows (the docs/design.md
#: §3 profile at 128 blocks: 0.2 s in all); blocks of random sizes and costs kept up to 80,000 at
#: 24 blocks (16 s). Past the cap the rows with the least resident bytes stay, and the budget
#: named is one a plan fits, perhaps not the least.
FRONT_CAP = 5000
#: The memory columns before any block: mem, excess, r, pend and nslot (cost.State's)
START = [0.0, 0.0, 0.0, -math.inf, 0.0]


def _descend(opts: list[list[OptionCost]], fitting: list[list[int]], hopeful: Callable[[np.ndarray], np.ndarray],
             depth: int) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The memory columns' Pareto front from the last block down to block 0 over each block's
    ``fitting`` choices, keeping the rows ``hopeful`` passes once the blocks below are added at
    their leanest: the last front (perhaps empty), and per block (from the last) each kept row's
    choice and its row in the block above's front."""
    n = len(opts)
    # The leanest completion of blocks 0..s-1: the least resident bytes, the least held at the
    # end, and the least worst backward point above what the processed blocks hold (a point is
    # what is held when it starts plus its transient; cost.memory_rows).
    lean_mem, lean_end, lean_point = np.zeros(n + 1), np.zeros(n + 1), np.full(n + 1, -math.inf)
    for s, (row, ok) in enumerate(zip(opts, fitting)):
        held = min(row[c].grads - row[c].act for c in ok)
        lean_mem[s + 1] = lean_mem[s] + min(row[c].persist + row[c].act for c in ok)
        lean_end[s + 1] = lean_end[s] + held
        lean_point[s + 1] = max(min(row[c].trans for c in ok), lean_point[s] + held)
    rows = np.array([START])
    layers = []
    for s in range(n - 1, -1, -1):
        row, ok = opts[s], fitting[s]
        grown = np.concatenate([_grown(rows, row[c], depth) for c in ok])
        chosen = np.repeat(np.array(ok), len(rows))
        parent = np.tile(np.arange(len(rows)), len(ok))
        lean = grown + np.array([lean_mem[s], 0.0, lean_end[s], 0.0, 0.0])
        lean[:, 1] = np.maximum(lean[:, 1], grown[:, 2] + lean_point[s])
        alive = hopeful(lean)
        grown, chosen, parent = grown[alive], chosen[alive], parent[alive]
        keep = pareto_front(grown, FRONT_CAP)[0]
        rows = grown[keep]
        layers.append((chosen[keep], parent[keep]))
    return rows, layers
