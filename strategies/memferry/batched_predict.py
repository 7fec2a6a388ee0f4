"""Predictions of many related plans in one pass of the cost model's recurrence.

:func:`~.cost.predict` runs the recurrence from the last block down (:func:`~.cost.advance_rows`),
one plan at a time. Plans that differ in a pattern share most of that work, and
:func:`~.cost.advance_rows` takes many states at once, so each function here carries every plan
of a pattern as a row:

* :func:`split_predictions`: the first ``K`` blocks take one unit, the rest another, every ``K``
  (the named ``residentK`` and ``deviceK`` families: ``named_plans.py``). ``3 n`` vectorised
  steps for ``n + 1`` plans, against ``n (n + 1)`` one by one.
* :func:`one_block_changes`: a plan with one block's unit changed, for every block and unit
  (the scheduler's note of each block's best alternative). A row diverges from the plan's own
  state at its block; the rows whose change lies above a block advance there together.

The arithmetic is the recurrence's own, row by row, so every prediction equals
:func:`~.cost.predict`'s to the bit (``tests/test_memferry_batched_predict.py``). Only
``host_optimizer_s`` is left 0, as :func:`~.cost.predict_options` leaves it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .block_costs import option_cost
from .config import Plan, UnitPlan
from .cost import Links, Prediction, State, advance_rows, finish, initial_state

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["split_predictions", "one_block_changes"]


def split_predictions(head: UnitPlan, tail: UnitPlan, profile: "StepProfile", links: Links, rest_optimizer: str,
                      prefetch_depth: int, margin: float) -> list[Prediction]:
    """The predictions of the plans whose first ``K`` blocks run ``head`` and the rest ``tail``,
    for ``K`` = 0 .. block count (item ``K``), with ``prefetch_depth`` and ``rest_optimizer``.

    Step and peak are :func:`~.cost.predict`'s to the bit; ``host_optimizer_s`` is left 0, as
    :func:`~.cost.predict_options` leaves it."""
    n = len(profile.blocks)
    heads = [option_cost(profile, links, i, head, prefetch_depth) for i in range(n)]
    tails = heads if tail == head else [option_cost(profile, links, i, tail, prefetch_depth) for i in range(n)]
    rows = np.repeat(np.array([initial_state(prefetch_depth).key()], dtype=float), n + 1, axis=0)
    for s in range(n - 1, -1, -1):
        below = s + 1 < n
        out = np.empty_like(rows)
        # rows K <= s: block s and the one above it (s + 1 >= K) take the tail
        out[:s + 1] = advance_rows(rows[:s + 1], tails[s], tails[s + 1] if below else None)
        # row K = s + 1: block s is the last head, the block above it the first tail
        out[s + 1:s + 2] = advance_rows(rows[s + 1:s + 2], heads[s], tails[s + 1] if below else None)
        if s + 2 <= n:  # rows K > s + 1: both take the head
            out[s + 2:] = advance_rows(rows[s + 2:], heads[s], heads[s + 1] if below else None)
        rows = out
    return [finish(State.from_key(rows[k], prefetch_depth), (heads if k else tails)[0], profile, links, rest_optimizer,
                   prefetch_depth, margin) for k in range(n + 1)]


def one_block_changes(plan: Plan, profile: "StepProfile", links: Links, margin: float,
                      choices: Sequence[UnitPlan]) -> dict[tuple[int, UnitPlan], Prediction]:
    """The prediction of ``plan`` with block ``i``'s unit replaced by ``c``, keyed ``(i, c)``,
    for every block and every ``c`` of ``choices`` other than the block's own unit."""
    n, depth = len(profile.blocks), plan.prefetch_depth
    own = [option_cost(profile, links, i, u, depth) for i, u in enumerate(plan.units)]
    alt = {c: [option_cost(profile, links, i, c, depth) for i in range(n)] for c in dict.fromkeys(choices)}
    base = np.array([initial_state(depth).key()], dtype=float)  # the plan's own state, blocks s+1..n-1
    rows = np.empty((0, base.shape[1]))
    labels: list[tuple[int, UnitPlan]] = []  # each row's change, the blocks nearest the end first
    fresh = 0  # rows whose change is at the block just done (the last ones)
    for s in range(n - 1, -1, -1):
        nxt = own[s + 1] if s + 1 < n else None
        parts = []
        if len(rows) > fresh:  # changed above block s + 1: the plan's own terms at s and s + 1
            parts.append(advance_rows(rows[:len(rows) - fresh], own[s], nxt))
        for j in range(len(rows) - fresh, len(rows)):  # changed at block s + 1: it is the next block
            parts.append(advance_rows(rows[j:j + 1], own[s], alt[labels[j][1]][s + 1]))
        changed = [c for c in alt if c != plan.units[s]]
        parts += [advance_rows(base, alt[c][s], nxt) for c in changed]  # changed here
        labels += [(s, c) for c in changed]
        fresh = len(changed)
        rows = np.concatenate(parts) if parts else rows
        base = advance_rows(base, own[s], nxt)
    return {(i, c): finish(State.from_key(row, depth), alt[c][0] if i == 0 else own[0], profile, links,
                           plan.rest_optimizer, depth, margin)
            for (i, c), row in zip(labels, rows)}
