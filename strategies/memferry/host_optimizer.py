"""AdamW on the host, one unit at a time, in a worker thread that overlaps the device.

A unit's update starts as soon as its gradient has landed in host memory, while the device
goes on with the rest of backward. It updates the fp32 master in place and rewrites the
compute-dtype working copy, which is where the next forward reads weights from: there is no
separate upload phase. Consumers wait per unit (:meth:`HostOptimizer.wait`), so the next
forward of unit *i* starts as soon as unit *i* is updated.

Global-norm clipping needs every gradient before any update. With ``max_grad_norm`` set,
the worker still receives, upcasts and measures each unit's gradient during backward, and
applies all updates once :meth:`finish_step` supplies the global norm: exact, less overlap.
"""
from __future__ import annotations

import math
import queue
import threading
from typing import Callable

import torch

from .config import AdamW
from .shadow import UnitShadow

__all__ = ["HostOptimizer"]


class HostOptimizer:
    """A worker thread applying AdamW to units' host buffers.

    Args:
        cfg: optimizer settings.
        shadows: all units' buffers, by unit index.
    """

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow]) -> None:
        self.cfg = cfg
        self.shadows = shadows
        self._optims = [self._make_optimizer(s) for s in shadows]
        self._done = [threading.Event() for _ in shadows]
        for ev in self._done:
            ev.set()
        self._tasks: queue.Queue = queue.Queue()
        self._pending: list[int] = []
        self._sqnorm = 0.0
        self._error: BaseException | None = None
        self.busy_s = 0.0  # seconds spent updating, for the scheduler's cost model
        self._thread = threading.Thread(target=self._run, name="memferry-host-adamw", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def submit(self, index: int, ready: Callable[[], None]) -> None:
        """Queue unit ``index``'s update; ``ready()`` blocks until its gradient is in host memory."""
        self._raise_if_failed()
        self._done[index].clear()
        self._tasks.put(("grad", index, ready))

    def finish_step(self) -> None:
        """All gradients of this step are submitted; with clipping, release the held updates."""
        self._raise_if_failed()
        if self.cfg.max_grad_norm is not None:
            self._tasks.put(("finish", None, None))

    def wait(self, index: int) -> None:
        """Block until unit ``index`` holds its latest update."""
        while not self._done[index].wait(timeout=0.5):
            self._raise_if_failed()
        self._raise_if_failed()

    def wait_all(self) -> None:
        """Block until every submitted update is applied."""
        for i in range(len(self.shadows)):
            self.wait(i)

    def _make_optimizer(self, s: UnitShadow) -> torch.optim.AdamW:
        # torch's fused CPU AdamW over the unit's flat master, with the moments living in our
        # pinned buffers (state given up front is used as is).
        cfg = self.cfg
        opt = torch.optim.AdamW([s.master], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                fused=True)
        opt.state[s.master] = {"step": torch.tensor(float(s.step)), "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
        return opt

    def sync_steps_from_shadows(self) -> None:
        """Take step counts from the shadows (after loading a checkpoint)."""
        for s, opt in zip(self.shadows, self._optims):
            opt.state[s.master]["step"] = torch.tensor(float(s.step))

    def set_lr(self, lr: float) -> None:
        """Learning rate for the updates applied from now on (a schedule calls this per step)."""
        for opt in self._optims:
            opt.param_groups[0]["lr"] = lr

    def close(self) -> None:
        """Stop the worker after the queued work."""
        self._tasks.put(("stop", None, None))
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ worker side
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the host optimizer failed; training state is no longer consistent") from self._error

    def _run(self) -> None:
        while True:
            kind, index, ready = self._tasks.get()
            if kind == "stop":
                return
            try:
                import time

                t0 = time.perf_counter()
                if kind == "grad":
                    ready()
                    s = self.shadows[index]
                    if s.grad is not s.grad_stage:
                        s.grad.copy_(s.grad_stage)
                    if self.cfg.max_grad_norm is None:
                        self._update(index, 1.0)
                    else:
                        self._sqnorm += float(s.grad.double().square().sum())
                        self._pending.append(index)
                elif kind == "finish":
                    norm = math.sqrt(self._sqnorm)
                    # torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), capped at 1.
                    coef = min(1.0, self.cfg.max_grad_norm / (norm + 1e-6))
                    self.last_grad_norm = norm
                    for i in self._pending:
                        self._update(i, coef)
                    self._pending, self._sqnorm = [], 0.0
                self.busy_s += time.perf_counter() - t0
            except BaseException as exc:  # surface in the training thread, never lose it
                self._error = exc
                for ev in self._done:
                    ev.set()
                return

    def _update(self, index: int, coef: float) -> None:
        s = self.shadows[index]
        if coef != 1.0:
            s.grad.mul_(coef)
        opt = self._optims[index]
        s.master.grad = s.grad
        opt.step()
        s.master.grad = None
        s.step = int(opt.state[s.master]["step"].item())
        if s.work is not s.master:
            s.work.copy_(s.master)
        self._done[index].set()
