"""Run a multi-process fault test in which one process stops itself (SIGSTOP): wait for the
other's report, then kill what is left (a stopped process cannot be joined)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def run_until_reported(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, report: Path,
                       deadline_s: float = 240) -> tuple[float, str]:
    """Spawn ``fn(rank, *args)`` on ``nprocs`` processes and wait (at most ``deadline_s``) for
    ``report``, which a process writes as ``"<elapsed seconds>\\n<outcome>"``; returns both."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    try:
        deadline = time.monotonic() + deadline_s
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    elapsed, outcome = report.read_text().split("\n", 1)
    return float(elapsed), outcome
