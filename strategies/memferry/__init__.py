"""MemFerry: training with parameters homed in host memory (see ``engine.MemFerry``; ``planning.plan_for``
chooses its plan: profiler -> cost model and scheduler -> executor)."""
from .config import AdamW, Plan, UnitPlan
from .engine import MemFerry
from .planning import plan_for
from .units import Unit, find_blocks, split_units

__all__ = ["MemFerry", "plan_for", "AdamW", "Plan", "UnitPlan", "Unit", "find_blocks", "split_units"]
