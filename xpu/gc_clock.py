"""Python's full garbage collections during timed steps, step by step.

A full (generation 2) collection holds the GIL while it walks every tracked object: 133-141 ms
on one core here with a 128-block engine built and nothing frozen
(``bench/results/2026-12-06-cpu-session45/gc_pauses.txt``), a stall of every Python thread
that lands in whichever step Python starts it. The benchmark's rows and MemFerry's rehearsal
report it beside their step times, so a slow step can be told from a slow system.
"""
from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["PAUSE_S", "FullCollections"]

#: A full collection worth a word beside a step: a walk of only what steps made takes about 1 ms
#: (MemFerry freezes its set-up out of them: ``strategies/memferry/gc_pauses.py``).
PAUSE_S = 0.010


class FullCollections:
    """Seconds of full collections per step, while entered (``gc.callbacks``).

    Attributes:
        steps: seconds of full collections in each step closed by :meth:`step_done`.
    """

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._open = 0.0
        self._started: float | None = None

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._open += time.perf_counter() - self._started
            self._started = None

    def step_done(self) -> None:
        """Close a step: the full collections since the last close are its."""
        self.steps.append(self._open)
        self._open = 0.0
