"""The plans :meth:`Plan.from_spec` names, and their predictions.

The scheduler starts its search from the best named plan that fits (its incumbent: a bound the
dynamic program must beat, and the plan kept where it cannot), and ``clip_plan.py`` weighs them
against the search's pick. ``residentK`` and ``deviceK`` name a plan for every ``K`` from 0 to
the block count, so a model of ``n`` blocks has about ``24 n`` of them. Priced one by one with
:func:`~.cost.predict`, each over ``n`` blocks, they were most of the 128-layer GPT's search: 26 s
in all before, 6 s now (2-core machine, bench/results/2026-12-06-cpu-session38/). Each such family
is two runs of units, head and tail, so all its splits are priced in one pass
(:func:`~.batched_predict.split_predictions`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .batched_predict import split_predictions
from .config import Plan, UnitPlan
from .cost import Links, Prediction, predict

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["named_plans", "named_predictions"]


def named_plans(n: int, choices: Sequence[UnitPlan], rest_optimizers: Sequence[str],
                depths: Sequence[int]) -> Iterator[Plan]:
    """Every plan :meth:`Plan.from_spec` names for ``n`` blocks (``prefetch``, ``prefetch2``,
    ``dha``, ``residentK``, ``deviceK``; plain, ``+recompute`` or ``+offload``) at each prefetch
    depth and place of ``rest``'s update, whose blocks all take one of ``choices``."""
    allowed = set(choices)
    specs = ["prefetch", "prefetch2", "dha"] + [f"{k}{i}" for k in ("resident", "device") for i in range(n + 1)]
    for spec in specs:
        for suffix in ("", "+recompute", "+offload"):
            base = Plan.from_spec(spec + suffix, n)
            if not set(base.units) <= allowed:
                continue
            for depth in depths:
                for rest in rest_optimizers:
                    yield Plan(list(base.units), depth, rest)


def named_predictions(profile: "StepProfile", links: Links, margin: float, choices: Sequence[UnitPlan],
                      rest_optimizers: Sequence[str], depths: Sequence[int]) -> list[tuple[Plan, Prediction]]:
    """Every plan of :func:`named_plans` over ``profile``'s blocks with its prediction (step and
    peak as :func:`~.cost.predict` gives them; ``host_optimizer_s`` 0), each family of splits
    priced in one pass (:func:`split_predictions`)."""
    n = len(profile.blocks)
    families: dict[tuple[UnitPlan, UnitPlan, int, str], list[Prediction]] = {}
    out = []
    for plan in named_plans(n, choices, rest_optimizers, depths):
        head, tail = plan.units[0], plan.units[-1]
        split = next((i for i, u in enumerate(plan.units) if u != head), n)  # blocks before the first tail one
        if plan.units[split:] != [tail] * (n - split):  # not two runs of units: priced on its own
            out.append((plan, predict(plan, profile, links, margin)))
            continue
        key = (head, tail, plan.prefetch_depth, plan.rest_optimizer)
        if key not in families:
            families[key] = split_predictions(head, tail, profile, links, plan.rest_optimizer, plan.prefetch_depth,
                                              margin)
        out.append((plan, families[key][split]))
    return out
