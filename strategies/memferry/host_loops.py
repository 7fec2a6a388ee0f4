"""Elementwise host loops compiled once, for a fixed row length, run over units of any size.

``torch.compile`` (Inductor's C++/OpenMP code on the host) turns an elementwise update into
one vectorised sweep. The old single-pass kernel, compiled for fully dynamic sizes, recompiled
inside training steps (a size-1 range and an fp32 accumulated gradient each made a new graph:
seconds of compiling on the host optimizer's thread) and baked the compiling thread's OpenMP
team size into its code. Here each loop is compiled once per dtype combination, for tensors
viewed as ``(rows, chunk)``: ``chunk`` (the row length) is fixed, so the inner loop is
vectorised with no remainder, and only the row count is symbolic (at least 2; one graph for
every count). A flat range of any size runs as its whole rows in one call, and its last
``< chunk`` elements (or all of a range shorter than two rows) through the same compiled
code on fixed ``(2, chunk)`` scratch (copied in, run, the written ones copied back). One call
per range matters besides compiling: each call's return re-takes the GIL, which a training
thread busy in Python hands over only every switch interval (5 ms).
The OpenMP team size is fixed at compile time (``cpp.threads``) to the host optimizer's.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["ChunkLoop", "adamw_loop", "accumulate_loop", "DEFAULT_CHUNK", "clear_cache"]

#: Row length: a multiple of every vector width; a range's tail and ranges shorter than two
#: rows (8 Ki elements) go through scratch, a negligible copy.
DEFAULT_CHUNK = 4096


def _adamw_master(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    # torch.optim.AdamW's single-tensor arithmetic, step for step, where the fp32 master is the
    # working copy (fp32 compute). scalars = [gradient scale, 1 - lr * weight_decay,
    # lr / bias_correction1, sqrt(bias_correction2)]: a tensor, so a new step, learning rate or
    # clip coefficient does not recompile.
    g = grad.float() * scalars[0]
    master.mul_(scalars[1])
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt() / scalars[3] + eps
    master.sub_(scalars[2] * exp_avg / denom)  # addcdiv_(exp_avg, denom, value=-step_size), same order


def _adamw_work(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                work: torch.Tensor, scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    # The same update, then the compute-dtype working copy written in the same pass.
    _adamw_master(master, grad, exp_avg, exp_avg_sq, scalars, beta1, beta2, eps)
    work.copy_(master)


def _accumulate(acc: torch.Tensor, grad: torch.Tensor) -> None:
    # acc += grad in fp32, reading the 16-bit gradient once (eager add_ of a bf16 tensor into an
    # fp32 one first makes a whole-tensor fp32 temporary on the CPU).
    acc.add_(grad.float())


class ChunkLoop:
    """One elementwise function compiled for flat tensors of fixed dtypes viewed as ``(rows, chunk)``.

    Args:
        fn: the function; its first ``len(dtypes)`` arguments are tensors of one shape, then
            ``extra`` (tensors or constants passed through unchanged).
        dtypes: the flat tensors' dtypes (a different combination is a different loop).
        mutated: positions of the tensors ``fn`` writes (copied back from the tail's scratch).
        chunk: the row length (fixed in the compiled code).
        threads: OpenMP threads of the compiled code (fixed when it is compiled).

    Raises at construction when it cannot compile here (no C++ compiler, no Inductor): it
    compiles then, on zero-filled buffers.
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
        self._fn = torch.compile(own, fullgraph=True, options={"cpp.threads": threads})
        self._tail = threading.Lock()  # the scratch is shared by every thread calling this loop
        # Grad mode is one of Dynamo's guards and thread-local: compile and run under one
        # (no_grad), so a worker thread never recompiles what the training thread compiled.
        with _disable_current_modes(), torch.no_grad():
            self._scratch = [torch.zeros(2, chunk, dtype=d) for d in self.dtypes]
            warm = [torch.zeros(3, chunk, dtype=d) for d in self.dtypes]
            for t in warm:
                torch._dynamo.mark_dynamic(t, 0)  # the row count is symbolic: one graph for all counts >= 2
            self._fn(*warm, *extra)  # compile now, not inside a training step

    def __call__(self, tensors: Sequence[torch.Tensor], extra: tuple = ()) -> None:
        """Run over flat contiguous ``tensors`` (one length, the loop's dtypes; any length), in place."""
        n = tensors[0].numel()
        c = self.chunk
        rows = n // c if n >= 2 * c else 0
        full = rows * c
        # Host buffers only: outside any dispatch mode (the cpu backend's device-memory
        # tracker is one), which torch.compile would refuse to run under.
        with _disable_current_modes(), torch.no_grad():
            if rows:
                self._fn(*(t[:full].view(rows, c) for t in tensors), *extra)
            if full < n:
                r = n - full
                with self._tail:
                    flat = [s.view(-1)[:r] for s in self._scratch]
                    torch._foreach_copy_(flat, [t[full:] for t in tensors])
                    self._fn(*self._scratch, *extra)
                    torch._foreach_copy_([tensors[i][full:] for i in self.mutated], [flat[i] for i in self.mutated])


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
