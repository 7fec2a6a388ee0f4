"""Where accumulated micro-batches are summed, settled by the rehearsal's wall clock.

Under gradient accumulation a host-updated block sums its earlier micro-batches' gradients on
the host (each comes home and is added into an fp32 sum there) or on the device (an fp32 device
buffer, the sum sent home once: ``UnitPlan.accumulate``). The cost model prices both, and on the
H200 machine it priced them unevenly: for the DESIGN §3 model at 8 micro-batches under 17.7 GB
its host-summing plan ran 6.7 % over its prediction in steps and 9 % in the rehearsal (1.279 s
predicted, 1.365 s and 1.394 s run), while its best device-summing plan came within 2 % and was
the faster of the two (1.308 s predicted, 1.3345 s run with clipping on; session 23, call 3).
In the host-summing plan's backward the compute and load streams both waited 1.1-2.2 ms before
each block while the previous one's gradients went home to be summed (the thread issuing them
was late): a term the model does not have.

So the rehearsal settles it on the wall clock. Where the scheduled plan sums any block on the
host, the scheduler's best plan summing every block it can on the device is made too; where it
sums on the device, its best plan summing none there (which on the H200 is the one that missed):
where the model cannot tell the two apart (the other predicted within :data:`WINDOW` of the
first: the size of the misses seen) both are rehearsed, timed, and whichever took less
wall-clock time per step is kept (the other is given back; building the first again costs one
more untimed rehearsal). A plan the host-rate check (``host_calibration.py``) made again in
another layout is timed as well; where it sums on the other side of the plan it replaced, those
two are the race. Which side wins moved with the lease's host: the host-summing plan
rehearsed 4 % faster on one lease and ran 8 % slower on another (session 24). Without
accumulation there is nothing to place. A rehearsed step is the mean of two on the wall clock
(``rehearsal.CLOCKED_STEPS``): the comparison can err where the two plans run within its noise
(one step varied by 1-2 % on the H200 machine), which is also where the choice matters least.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .host_calibration import repriced, same_layout
from .links import links_from_probe
from .planning import replan
from .scheduler import NoPlanFitsError, sums_on_host_by_choice

if TYPE_CHECKING:
    from .config import Plan
    from .engine import MemFerry

__all__ = ["PLACEMENTS", "SumPlacement", "WINDOW", "host_summed_blocks", "device_summed_blocks"]

#: Predictions this close (relative) do not tell two plans apart: the model missed host-summing
#: plans by 7-11 % (H200, sessions 21-23).
WINDOW = 0.10
#: ``MemFerry(sum_placement=...)``: race the two placements, or keep the scheduler's pick.
PLACEMENTS = ("race", "plan")


def host_summed_blocks(plan: "Plan") -> int:
    """Blocks of ``plan`` that sum micro-batches on the host where the device could."""
    return sum(sums_on_host_by_choice(u) for u in plan.units)


def device_summed_blocks(plan: "Plan") -> int:
    """Blocks of ``plan`` that sum micro-batches on the device (``accumulate="device"``)."""
    return sum(u.accumulate == "device" for u in plan.units)


def _side(plan: "Plan") -> str | None:
    """Where ``plan`` sums: ``"host"`` (any block on the host), ``"device"``, or None (nowhere)."""
    return "host" if host_summed_blocks(plan) else "device" if device_summed_blocks(plan) else None


class SumPlacement:
    """One comparison inside :func:`~.rehearsal.fit_by_rehearsal`: at most one per engine.

    Attributes:
        timing: the alternative is built; its next rehearsal is to be timed and settled.
        notes: what was compared and kept, for the plan's notes.
    """

    def __init__(self, race: bool = True) -> None:
        self.timing = False
        self.notes: list[str] = []
        self._tried = not race  # "plan": nothing to compare
        self._original: Plan | None = None
        self._original_s = 0.0
        self._side, self._other = "host", "device"  # where the first plan sums, and the alternative
        self._before: tuple[Plan, float] | None = None  # a timed plan the host-rate check replaced

    @property
    def original_s(self) -> float:
        """The wall-clock step of the plan the comparison started from (seconds)."""
        return self._original_s

    def may_race(self, engine: "MemFerry") -> bool:
        """Whether a comparison may still start from ``engine``'s plan (none has; it accumulates)."""
        return not self._tried and engine.micro.steps > 1

    def replaced(self, plan: "Plan", step_s: float | None) -> None:
        """The host-rate check replaced ``plan``, rehearsed at ``step_s``, by a plan of another
        layout: where that one sums on the other side, the two race on their timed rehearsals
        (:meth:`after_replacement`), with no search for another rival."""
        if step_s is not None:
            self._before = (plan, step_s)

    def after_replacement(self, engine: "MemFerry", step_s: float | None, budget: int, margin: float) -> "Plan | None":
        """After the replacing plan's timed rehearsal (``step_s``): where it sums on the other side
        of the replaced one, keep the faster (None: keep it; else the replaced plan, priced on the
        calibrated profile, to build again); otherwise :meth:`alternative`."""
        before = self._before
        now = _side(engine.plan)
        if before is None or step_s is None or now is None or _side(before[0]) in (None, now) or self._tried:
            return self.alternative(engine, step_s, budget, margin)
        plan, before_s = before
        self._tried = True
        self._side, self._other = str(_side(plan)), now
        links = links_from_probe(engine.backend, engine.device)
        self._original, self._original_s = repriced(plan, engine.plan.profile, links, margin), before_s
        self.notes.append(f"sum placement: the host-rate check moved the plan from summing on the {self._side} "
                          f"(rehearsed at {before_s * 1e3:.1f} ms per step) to summing on the {now}")
        return self.settle(step_s)

    def alternative(self, engine: "MemFerry", step_s: float | None, budget: int, margin: float) -> "Plan | None":
        """The plan to build and rehearse next: where ``engine.plan`` (rehearsed at ``step_s``)
        sums on the host, the scheduler's best plan summing on the device, and where it sums on
        the device, its best plan summing on the host; None where that is predicted more than
        :data:`WINDOW` slower, where none fits ``budget``, or where the plan sums nothing."""
        plan = engine.plan
        predicted = plan.predicted_step_s
        if self._tried or step_s is None or not predicted or engine.micro.steps < 2 or plan.profile is None:
            return None
        host, device = host_summed_blocks(plan), device_summed_blocks(plan)
        if not host and not device:
            return None
        self._tried = True
        self._side, self._other = ("host", "device") if host else ("device", "host")
        said = (f"sum placement: the plan summing {host or device} blocks' micro-batches on the {self._side} "
                f"(predicted {predicted * 1e3:.1f} ms) rehearsed at {step_s * 1e3:.1f} ms per step")
        try:
            other = replan(plan, budget, engine.backend, engine.device, margin, host_sums=not host,
                           device_sums=not device)
        except NoPlanFitsError:
            self.notes.append(said + f"; no plan summing on the {self._other} fits the budget")
            return None
        guess = other.predicted_step_s or 0.0
        if same_layout(other, plan) or guess > predicted * (1 + WINDOW):
            self.notes.append(said + f"; the best plan summing on the {self._other} is predicted at "
                                     f"{guess * 1e3:.1f} ms: not rehearsed")
            return None
        self._original, self._original_s, self.timing = plan, step_s, True
        self.notes.append(said + f"; the best plan summing on the {self._other}, predicted at {guess * 1e3:.1f} ms, is "
                                 f"rehearsed too")
        return other

    def settle(self, step_s: float | None) -> "Plan | None":
        """After the alternative's timed rehearsal (``step_s``): None to keep it, or the plan it
        was compared with, to build again (it was faster)."""
        self.timing = False
        if step_s is not None and step_s < self._original_s:
            self.notes.append(f"sum placement: the {self._other}-summing plan rehearsed at {step_s * 1e3:.1f} ms: kept")
            return None
        ran = f"{step_s * 1e3:.1f} ms" if step_s is not None else "an untimed step"
        self.notes.append(f"sum placement: the {self._other}-summing plan rehearsed at {ran}: the {self._side}-summing "
                          f"plan kept")
        return self._original

    def overshot(self, peak: str) -> "Plan":
        """The alternative peaked over the budget (``peak``, as written): the plan to build again."""
        self.timing = False
        self.notes.append(f"sum placement: the {self._other}-summing plan peaked at {peak}, over the budget: the "
                          f"{self._side}-summing plan kept")
        assert self._original is not None
        return self._original
