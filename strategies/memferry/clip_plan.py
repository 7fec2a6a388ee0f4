"""Plans for a clip that fires: the scheduler's pick weighed against plans that lose less when it does.

The scheduler's search minimises the step whose clip does not fire. When it fires, every host
update waits for the coefficient at backward's end (:func:`~.cost.predict_clip_fired`), and a
plan that overlapped much host work with backward loses all of it. Plans with fewer
host-updated blocks, and those at the end of the model (updated while the next forward runs
the device-homed ones first), lose less. Given the share of steps expected to clip
(``AdamW.clip_fire_rate``), :func:`for_clip` keeps the search's plan unless a named plan
(:func:`named_plans`: ``deviceN``, ``residentN``, ``prefetch``, with or without recomputation)
has a smaller expected step, ``(1 - rate) * step + rate * fired step``, within the budget.

On the 17-layer starved GPT's profile (16 GB, bench/results/2026-12-03-h200-session17/call1/s17)
the search's plan predicts 128 ms and 202 ms after a clipped step; fifteen device-homed blocks
predict 135 and 152: at the 36 % firing rate measured there, 141 ms against 155 expected.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from .config import Plan
from .cost import Links, Prediction, predict, predict_clip_fired
from .named_plans import named_plans  # re-exported: where for_clip's candidates come from

if TYPE_CHECKING:
    from .profiler import StepProfile

__all__ = ["named_plans", "expected_step", "for_clip", "fire_rate_hint", "HINT_STEP"]

#: The step after which the engine compares the clip's firing with the rate planned for.
HINT_STEP = 50


def expected_step(plan: Plan, profile: "StepProfile", links: Links, margin: float, rate: float) -> float:
    """``(1 - rate) * predict + rate * predict_clip_fired`` for ``plan``: its mean step when a share
    ``rate`` of steps clip (each such step's cost shows in the step after it)."""
    normal = predict(plan, profile, links, margin).step_s
    return normal if rate == 0 else (1 - rate) * normal + rate * predict_clip_fired(plan, profile, links, margin).step_s


def for_clip(plan: Plan, profile: "StepProfile", links: Links, budget: float, margin: float, rate: float,
             candidates: Iterable[tuple[Plan, Prediction]]) -> tuple[Plan, str]:
    """The plan of least :func:`expected_step` among ``plan`` and ``candidates`` (each with its
    :func:`~.cost.predict`) that fit ``budget`` (``plan`` on a tie), and a note saying what was
    weighed."""
    best, best_e = plan, expected_step(plan, profile, links, margin, rate)
    first = best_e
    for cand, normal in candidates:
        if normal.peak_bytes > budget or normal.step_s >= best_e:  # a fired step is never faster
            continue
        e = (1 - rate) * normal.step_s + rate * predict_clip_fired(cand, profile, links, margin).step_s
        if e < best_e:
            best, best_e = cand, e
    if best is plan:
        return plan, (f"note: with the clip firing in {rate:.0%} of steps (AdamW.clip_fire_rate) the search's plan "
                      f"has the least expected step, {first * 1e3:.1f} ms")
    return best, (f"note: with the clip firing in {rate:.0%} of steps (AdamW.clip_fire_rate) this plan's expected step "
                  f"is {best_e * 1e3:.1f} ms against {first * 1e3:.1f} for the search's plan, which is faster "
                  f"when the clip does not fire")


def fire_rate_hint(clipped: int, steps: int, planned: float) -> str | None:
    """A line for the log when the clip fired in a share of ``steps`` at least 0.2 and over 0.15
    from the ``planned`` rate (``AdamW.clip_fire_rate``): the plan may then not be the one of
    least expected step. None otherwise."""
    rate = clipped / steps if steps else 0.0
    if rate < 0.2 or abs(rate - planned) <= 0.15:
        return None
    return (f"MemFerry: the clip fired in {clipped} of the first {steps} steps, the plan assumed {planned:.0%}; each "
            f"such step waits for every host update after backward. AdamW(clip_fire_rate={rate:.2f}) (xpu train: "
            f"strategy.options.clip_fire_rate) makes plan='auto' weigh those steps")
