"""Elementwise host loops compiled once for one fixed chunk length, run chunk by chunk.

``torch.compile`` (Inductor's C++/OpenMP code on the host) turns an elementwise update into
one vectorised sweep. Compiled for *dynamic* sizes, the old single-pass kernel recompiled
inside training steps (a size-1 range and an fp32 accumulated gradient each made a new graph,
seconds of compiling on the host optimizer's thread) and baked the main thread's OpenMP team
size into its code. Here each loop is compiled once per dtype combination, for exactly
``chunk`` elements (``dynamic=False``): a unit of any size runs as whole chunks through that
one kernel, and its tail (fewer than ``chunk`` elements) through the same kernel on
fixed-size scratch buffers (copied in, run, the mutated ones copied back), so no size ever
compiles again. The OpenMP team size is fixed at compile time (``cpp.threads``) to the host
optimizer's thread count.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["ChunkLoop", "adamw_loop", "accumulate_loop", "DEFAULT_CHUNK", "clear_cache"]

#: Elements per compiled call: 1 Mi elements is 28 MB of traffic per AdamW call (about 0.25 ms
#: at host-memory bandwidth), so the per-call overhead (guards, OpenMP fork/join: tens of
#: microseconds) stays a few percent, and a unit's tail through scratch costs at most one chunk.
DEFAULT_CHUNK = 1 << 20


def _adamw_work(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                work: torch.Tensor, scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    # torch.optim.AdamW's single-tensor arithmetic, step for step. scalars = [gradient scale,
    # 1 - lr * weight_decay, lr / bias_correction1, sqrt(bias_correction2)]: a tensor, so a new
    # step, learning rate or clip coefficient does not recompile.
    g = grad.float() * scalars[0]
    master.mul_(scalars[1])
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / scalars[3] + eps
    master.sub_(scalars[2] * exp_avg / denom)  # addcdiv_(exp_avg, denom, value=-step_size), same order
    work.copy_(master)


def _adamw_master(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    # The same update where the fp32 master is the working copy (fp32 compute): no write-back.
    g = grad.float() * scalars[0]
    master.mul_(scalars[1])
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / scalars[3] + eps
    master.sub_(scalars[2] * exp_avg / denom)  # addcdiv_(exp_avg, denom, value=-step_size), same order


def _accumulate(acc: torch.Tensor, grad: torch.Tensor) -> None:
    # acc += grad in fp32, reading the 16-bit gradient once (eager add_ of a bf16 tensor into an
    # fp32 one first makes a whole-tensor fp32 temporary on the CPU).
    acc.add_(grad.float())


class ChunkLoop:
    """One elementwise function compiled for ``chunk``-element flat tensors of fixed dtypes.

    Args:
        fn: the function; its first ``len(dtypes)`` arguments are flat tensors of one length,
            then ``extra`` (tensors or constants passed through unchanged).
        dtypes: the flat tensors' dtypes (a different combination is a different loop).
        mutated: positions of the flat tensors ``fn`` writes (copied back from the tail's scratch).
        chunk: elements per compiled call.
        threads: OpenMP threads of the compiled code (fixed when it is compiled).

    Raises at construction when it cannot compile here (no C++ compiler, no Inductor): the
    first call compiles, on zero-filled scratch.
    """

    def __init__(self, fn: Callable, dtypes: Sequence[torch.dtype], mutated: Sequence[int], chunk: int,
                 threads: int, extra: tuple = ()) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.chunk, self.dtypes, self.mutated, self.threads = chunk, tuple(dtypes), tuple(mutated), threads
        # Dynamo keeps compiled graphs per code object, with a limit on how many: a fresh code
        # object per loop keeps every (function, dtypes, chunk) from evicting another.
        name = f"{fn.__name__}_{chunk}_{'_'.join(str(d).split('.')[-1] for d in self.dtypes)}"
        own = type(fn)(fn.__code__.replace(co_name=name), fn.__globals__, name)
        self._fn = torch.compile(own, dynamic=False, fullgraph=True, options={"cpp.threads": threads})
        with _disable_current_modes():
            self._scratch = [torch.zeros(chunk, dtype=d) for d in self.dtypes]
            self._fn(*self._scratch, *extra)  # compile now, not inside a training step

    def __call__(self, tensors: Sequence[torch.Tensor], extra: tuple = ()) -> None:
        """Run over flat ``tensors`` (one length, the loop's dtypes; any length), in place."""
        n = tensors[0].numel()
        c = self.chunk
        full = n - n % c
        # Host buffers only: outside any dispatch mode (the cpu backend's device-memory
        # tracker is one), which torch.compile would refuse to run under.
        with _disable_current_modes():
            for a in range(0, full, c):
                self._fn(*(t[a:a + c] for t in tensors), *extra)
            if full < n:
                r = n - full
                for s, t in zip(self._scratch, tensors):
                    s[:r].copy_(t[full:])
                self._fn(*self._scratch, *extra)
                for i in self.mutated:
                    tensors[i][full:].copy_(self._scratch[i][:r])


_CACHE: dict[tuple, ChunkLoop] = {}
_LOCK = threading.Lock()


def _loop(key: tuple, make: Callable[[], ChunkLoop]) -> ChunkLoop:
    with _LOCK:  # compiled once per process and shared: the profiler and the engine build kernels too
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


def adamw_loop(grad_dtype: torch.dtype, work_dtype: torch.dtype | None, betas: tuple[float, float], eps: float,
               chunk: int = DEFAULT_CHUNK, threads: int | None = None) -> ChunkLoop:
    """The compiled single-pass AdamW for these dtypes (``work_dtype`` None: the master is the
    working copy), cached per process. Call it with ``[master, grad, exp_avg, exp_avg_sq(, work)]``
    and ``extra=(scalars, beta1, beta2, eps)``."""
    threads = threads or torch.get_num_threads()
    b1, b2, eps = float(betas[0]), float(betas[1]), float(eps)
    consts = (torch.ones(4), b1, b2, eps)
    if work_dtype is None:
        dtypes, fn = (torch.float32, grad_dtype, torch.float32, torch.float32), _adamw_master
        mutated = (0, 2, 3)
    else:
        dtypes, fn = (torch.float32, grad_dtype, torch.float32, torch.float32, work_dtype), _adamw_work
        mutated = (0, 2, 3, 4)
    key = ("adamw", dtypes, b1, b2, eps, chunk, threads)
    return _loop(key, lambda: ChunkLoop(fn, dtypes, mutated, chunk, threads, consts))


def accumulate_loop(grad_dtype: torch.dtype, chunk: int = DEFAULT_CHUNK, threads: int | None = None) -> ChunkLoop:
    """The compiled ``acc += grad`` (fp32 ``acc``), cached per process; call with ``[acc, grad]``."""
    threads = threads or torch.get_num_threads()
    dtypes = (torch.float32, grad_dtype)
    return _loop(("acc", dtypes, chunk, threads), lambda: ChunkLoop(_accumulate, dtypes, (0,), chunk, threads))


def clear_cache() -> None:
    """Forget every compiled loop (tests that simulate a machine without a compiler)."""
    with _LOCK:
        _CACHE.clear()
