"""MemFerry: training with parameters homed in host memory (see ``engine.MemFerry``)."""
from .config import AdamW, Plan, UnitPlan
from .engine import MemFerry
from .units import Unit, find_blocks, split_units

__all__ = ["MemFerry", "AdamW", "Plan", "UnitPlan", "Unit", "find_blocks", "split_units"]
