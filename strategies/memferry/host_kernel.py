"""The host AdamW update of one unit: two interchangeable kernels.

``single-pass`` (the default where it builds): one C loop (:mod:`.host_loops`, called
through ``ctypes`` with the GIL released) reads the 16-bit gradient, updates the fp32 master
and moments and writes the compute-dtype working copy in one sweep, 28 bytes per bf16
parameter, split over the host optimizer's threads. Two earlier builds with ``torch.compile``
were slower than ``torch`` inside real steps on the H200 machine: a dynamic-size one recompiled
inside steps (bench/results/2026-11-29-h200-session2/), and a fixed-row one, though its host
time was lower, held the GIL through every call and starved the training thread (0.174 s
against 0.119 s per 17-layer starved step, 2026-12-02).

``torch``: three passes of torch ops, cache-sized chunk by chunk: upcast the landed gradient
into fp32 scratch, torch's fused AdamW over the fp32 master, write the master back into the
working copy (close to 28 bytes per parameter of memory traffic, three sweeps of work).

``auto`` is ``single-pass`` when it builds here and agrees with ``torch.optim.AdamW`` on a
check update, else ``torch`` (a warning says why); the kernel's ``name`` says which ran. Both
give AdamW as ``torch.optim.AdamW`` defines it (decoupled weight decay, bias-corrected
moments, fp32 master and moments), equal up to fp32 rounding (FMA contraction).

Both also sum accumulated micro-batches (:meth:`HostKernel.accumulate`) in one in-place pass
per micro-batch: eager ``acc.add_(bf16_grad)`` first materialises a whole fp32 copy of the
gradient on the CPU (TensorIterator promotes CPU inputs into temporaries).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .adamw import decay_ranges, flat_adamw, squared_norm
from .host_loops import UnavailableError, host_loops
from .config import AdamW
from .shadow import UnitShadow

__all__ = ["PHASES", "Triple", "HostKernel", "TorchKernel", "SinglePassKernel", "make_host_kernel", "default_chunk", "KERNELS"]

_log = logging.getLogger("xpu.memferry")

KERNELS = ("auto", "torch", "single-pass")


#: What the host optimizer's time is spent on, per update (``HostOptimizer.time_s`` adds the waits).
#: ``call``: the single-pass loops' calls beyond the loop itself, clocked inside the call: their
#: Python side and taking the GIL back when the loop returns (the training thread may hold it).
PHASES = ("upcast", "adamw", "call", "writeback", "backup")

#: A unit's master, exp_avg and exp_avg_sq in a backup (speculative clipping's arena).
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HostKernel:
    """Applies one AdamW step to a host-homed unit (gradient already in ``grad_source``: the
    landed ``grad_stage``, or the fp32 sum of a step's micro-batches; or the sum of
    ``grad_terms``, a last pair of micro-batches the kernel adds as it reads them).

    ``apply`` returns the seconds spent per phase (``upcast``, ``adamw``, ``writeback``,
    ``backup``; a single-pass kernel reports its sweeps as ``adamw``) and advances ``shadow.step``.
    :meth:`pieces` does the same update a piece at a time, so the host optimizer's worker can
    answer the training thread between pieces.
    """

    name = "?"
    #: Whether the kernel keeps its own references to each unit's master and moments (so a
    #: unit's state must stay in the buffers it had at construction: no twin for speculative
    #: clipping, ``speculative_clip.py``).
    binds_state = False
    #: Whether :meth:`split` is built (the copy-first pass of ``split_update.py``).
    splits = False
    #: Seconds so far that :meth:`accumulate` and :meth:`accumulate_pair` took beyond their loops
    #: (the single-pass loops' Python side and taking the GIL back; 0 for torch's ops): the
    #: host optimizer moves them from ``upcast`` to ``call``.
    sum_call_s = 0.0

    def pieces(self, s: UnitShadow, coef: float, save: Triple | None = None, source: Triple | None = None,
               whole: bool = False) -> Iterator[dict[str, float]]:
        """One update of ``s`` with its gradient scaled by ``coef`` (global-norm clipping), a
        piece at a time (seconds per phase after each); ``s.step`` advances after the last.

        ``save``: also write the old master and moments there (speculative clipping's backup);
        ``source``: take the old master and moments from there (a rollback); ``whole``: in as
        few pieces as the kernel can (nothing waits between them).
        """
        raise NotImplementedError

    def split(self, s: UnitShadow, pending: torch.Tensor, whole: bool = False,
              coef: float = 1.0) -> tuple[Iterator[dict[str, float]], Iterator[dict[str, float]]]:
        """The update in two passes (only where :attr:`splits`; :meth:`SinglePassKernel.split`)."""
        raise NotImplementedError(f"the {self.name} kernel does not split updates")

    def apply(self, s: UnitShadow, coef: float, save: Triple | None = None,
              source: Triple | None = None) -> dict[str, float]:
        """:meth:`pieces` all at once: the seconds per phase of the whole update."""
        total = dict.fromkeys(PHASES, 0.0)
        for times in self.pieces(s, coef, save, source, whole=True):
            for phase, seconds in times.items():
                total[phase] += seconds
        return total

    def sqnorm(self, t: torch.Tensor) -> float:
        """The sum of ``t``'s squares in fp64 (a gradient, for the clip coefficient)."""
        return float(squared_norm(t))

    def set_lr(self, lr: float) -> None:
        """Learning rate of the following updates."""
        raise NotImplementedError

    def sync_step(self, s: UnitShadow) -> None:
        """Take the step count from ``s.step`` (after loading a checkpoint)."""

    def accumulate_pair(self, acc: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, init: bool) -> None:
        """Two micro-batches' gradients into the fp32 sum: ``acc = g0 + g1`` (``init``: the step's
        first two) or ``acc += g0`` then ``acc += g1``, bit-equal to landing them one by one."""
        if init:
            acc.copy_(g0)
        else:
            self.accumulate(acc, g0)
        self.accumulate(acc, g1)

    def accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> None:
        """``acc += grad`` in place (fp32 ``acc``, a micro-batch's gradient of any float dtype),
        without a whole-size fp32 temporary (eager ``acc.add_(bf16)`` makes one on the CPU)."""
        if grad.dtype == acc.dtype:
            acc.add_(grad)
            return
        step = 1 << 20  # upcast through one cache-sized fp32 chunk, reused
        scratch = getattr(self, "_acc_scratch", None)
        if scratch is None or scratch.numel() < min(step, grad.numel()):
            with _disable_current_modes():
                scratch = self._acc_scratch = torch.empty(min(step, grad.numel()), dtype=torch.float32)
        for a in range(0, grad.numel(), step):
            b = min(a + step, grad.numel())
            part = scratch[: b - a]
            part.copy_(grad[a:b])
            acc[a:b].add_(part)


def _cut(v: object, a: int, b: int) -> object:
    """Elements ``a:b`` of a tensor or of each tensor of a tuple; anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v[a:b]
    return tuple(t[a:b] for t in v) if isinstance(v, tuple) else v


def _l3_bytes() -> int | None:
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units and text[:-1].isdigit() else None


def default_chunk() -> int:
    """Elements per chunk of :class:`TorchKernel`: a chunk's fp32 master, moments and gradient
    scratch plus its 16-bit gradient and weights take 20 B per element; half the L3 cache
    holds it (300 MiB on the H200 machine: 7.9 Mi elements), so the upcast's output and the
    updated master are still cached when the next pass reads them. 1 Mi at least, 4 Mi when
    the cache size is unknown."""
    l3 = _l3_bytes()
    return max(1 << 20, l3 // 40) if l3 else 4 << 20


class TorchKernel(HostKernel):
    """Upcast, torch's fused AdamW, write back, chunk by chunk (see the module docstring).

    Working in cache-sized chunks keeps the three passes' intermediate traffic in the CPU's
    cache, and needs only one chunk of fp32 gradient scratch instead of a whole fp32 gradient
    per unit (4 bytes per parameter of host memory saved).
    """

    name = "torch"
    binds_state = True  # a torch optimizer per chunk, over views of the unit's buffers

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow], chunk: int | None = None) -> None:
        chunk = default_chunk() if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.chunk = chunk
        # Chunks never straddle the weight-decay boundary: each is in one group (decay or none).
        ranges = {id(s): decay_ranges(s.master.numel(), s.decay_end, chunk) for s in shadows}
        self._bounds = {key: [(a, b) for a, b, _ in r] for key, r in ranges.items()}
        self._optims = {id(s): [flat_adamw(s.master[a:b], s.exp_avg[a:b], s.exp_avg_sq[a:b], s.step, cfg,
                                           weight_decay=None if decays else 0.0)
                                for a, b, decays in ranges[id(s)]] for s in shadows}
        # Upcast (16-bit) or summed (a last pair, ``UnitShadow.grad_terms``) gradients need scratch.
        low = [s for s in shadows if s.grad_stage.dtype != torch.float32 or s.grad_stage2 is not None]
        largest = max((min(chunk, s.master.numel()) for s in low), default=0)
        # One fp32 gradient chunk, reused: the worker updates one unit at a time.
        self._scratch = torch.empty(largest, dtype=torch.float32) if largest else None

    def pieces(self, s: UnitShadow, coef: float, save: Triple | None = None, source: Triple | None = None,
               whole: bool = False) -> Iterator[dict[str, float]]:
        terms = s.grad_terms  # cache-sized chunks either way: the three passes need them
        src = terms[0]
        low = src.dtype != torch.float32 or len(terms) > 1
        work = None if s.master_is_work else s.train_work
        state = (s.master, s.exp_avg, s.exp_avg_sq)
        bounds = self._bounds[id(s)]
        if not bounds:  # nothing trainable: the step still counts
            s.step += 1
            yield {}
        for k, ((a, b), opt) in enumerate(zip(bounds, self._optims[id(s)])):
            times = {"upcast": 0.0, "adamw": 0.0, "writeback": 0.0, "backup": 0.0}
            t0 = time.perf_counter()
            for mine, other in zip(state, save or ()):
                other[a:b].copy_(mine[a:b])
            for mine, other in zip(state, source or ()):
                mine[a:b].copy_(other[a:b])
            times["backup"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if low:
                g = self._scratch[: b - a]
                g.copy_(src[a:b])
                for t in terms[1:]:  # a last pair, added in accumulate_pair's order
                    g.add_(t[a:b])
            else:
                g = src[a:b]  # fp32 gradients (landed or accumulated) are used in place; consumed by this update
            if coef != 1.0:
                g.mul_(coef)
            t1 = time.perf_counter()
            p = opt.param_groups[0]["params"][0]
            p.grad = g
            opt.step()
            p.grad = None
            t2 = time.perf_counter()
            if work is not None:
                work[a:b].copy_(p)
            t3 = time.perf_counter()
            times["upcast"] += t1 - t0
            times["adamw"] += t2 - t1
            times["writeback"] += t3 - t2
            if k == len(bounds) - 1:
                s.step += 1
            yield times

    def set_lr(self, lr: float) -> None:
        for opts in self._optims.values():
            for opt in opts:
                opt.param_groups[0]["lr"] = lr

    def sync_step(self, s: UnitShadow) -> None:
        for opt in self._optims[id(s)]:
            p = opt.param_groups[0]["params"][0]
            opt.state[p]["step"] = torch.tensor(float(s.step))


def _beyond(t0: float, loop_s: float) -> float:
    """Seconds since ``t0`` (a loop call's start) beyond the ``loop_s`` the loop clocked inside it:
    the call's Python side and taking the GIL back."""
    return max(0.0, time.perf_counter() - t0 - loop_s)


class SinglePassKernel(HostKernel):
    """Upcast + AdamW + write-back as one C loop with the GIL released (:mod:`.host_loops`).

    ``threads``: the loop's threads (``cfg.host_threads``, else torch's current intra-op count).
    Raises :class:`~.host_loops.UnavailableError` at construction where the loops cannot be
    built here (the caller falls back).
    """

    name = "single-pass"
    splits = True

    #: Elements per piece (:meth:`HostKernel.pieces`): about 5 ms at the H200 host's rate, the
    #: longest the worker keeps the training thread waiting for a gradient norm, or a unit due
    #: sooner (``AdamW.host_order="deadline"``). Each call ends when its slowest thread does:
    #: with a fixed part per thread, 16 M-element pieces of a 50 M update ran 20 % slower per
    #: parameter than one call on the H200's host; with parts handed out in chunks
    #: (``host_loops.c``), 4.5 % (bench/results/2026-12-03-h200-session17/). A whole update is
    #: one call per weight-decay group; the loop keeps its threads between calls.
    piece = 1 << 24

    def __init__(self, cfg: AdamW, shadows: list[UnitShadow] = (), threads: int | None = None) -> None:
        self.cfg = cfg
        self.lr = cfg.lr
        self.piece = cfg.host_piece or type(self).piece  # AdamW.host_piece, for an A/B of the calls' cost
        self.threads = threads or cfg.host_threads or torch.get_num_threads()
        self._loops = host_loops()  # built (or loaded from the cache) now, not inside a training step
        for s in shadows:
            for t in (s.grad_stage, None if s.master_is_work else s.train_work):
                if t is not None and t.dtype not in self._loops.dtypes:
                    raise UnavailableError(f"dtype {t.dtype} is not built here")

    def pieces(self, s: UnitShadow, coef: float, save: Triple | None = None, source: Triple | None = None,
               whole: bool = False) -> Iterator[dict[str, float]]:
        # step and rate fixed for the whole unit, whatever happens between pieces
        return self._sweep(s, s.step + 1, self.lr, s.grad_terms, coef, whole, save=save, source=source)

    def split(self, s: UnitShadow, pending: torch.Tensor, whole: bool = False,
              coef: float = 1.0) -> tuple[Iterator[dict[str, float]], Iterator[dict[str, float]]]:
        """``s``'s update, its gradient scaled by ``coef`` (clipping), in two passes, each a
        piece at a time: the first writes the working copy and the step's whole gradient in fp32
        into ``pending``, leaves the master, moments and ``s.step`` as they were and sets
        ``s.copied`` to the new step with its last piece; the second, run once the first is done,
        updates them in place from ``pending`` (the gradient unscaled) and advances ``s.step``.
        Together bit-equal to :meth:`pieces`; both use the step and learning rate of now
        (``split_update.py``)."""
        if s.master_is_work:
            raise ValueError(f"unit {s.unit.name}: an fp32-compute unit's master is its working copy; it is not split")
        step, lr = s.step + 1, self.lr
        return (self._sweep(s, step, lr, s.grad_terms, coef, whole, mark="copied", copy_first=True, grad_out=pending),
                self._sweep(s, step, lr, (pending,), coef, whole, write_work=False))

    def _sweep(self, s: UnitShadow, step: int, lr: float, terms: tuple[torch.Tensor, ...], coef: float, whole: bool,
               mark: str = "step", write_work: bool = True, **form: object) -> Iterator[dict[str, float]]:
        """The loop over ``s``'s decay groups (in pieces unless ``whole``) at ``step`` and ``lr``,
        reading ``terms``; ``write_work``: write the unit's working copy (never where the master
        is it); ``mark``: the attribute of ``s`` set to ``step`` with the last piece (``step``, or
        a split update's ``copied``); ``form``: the loop's ``save``, ``source``, ``copy_first``
        and ``grad_out``, cut to each piece."""
        b1, b2 = (float(b) for b in self.cfg.betas)
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        work = s.train_work if write_work and not s.master_is_work else None
        # A last sliver joins the piece before it: every call's return takes the GIL back (a
        # 50 M unit cut at 2**24 made a fourth call for its last 27 k parameters).
        ranges = decay_ranges(s.master.numel(), s.decay_end, None if whole else self.piece, tail=self.piece // 8)
        if not ranges:  # nothing trainable: the step still counts
            setattr(s, mark, step)
            yield {}
        for k, (a, b, decays) in enumerate(ranges):
            t0 = time.perf_counter()
            wd = self.cfg.weight_decay if decays else 0.0
            cut = {key: _cut(v, a, b) for key, v in form.items() if v is not None}
            loop_s = self._loops.adamw(s.master[a:b], tuple(t[a:b] for t in terms), s.exp_avg[a:b],
                                       s.exp_avg_sq[a:b], None if work is None else work[a:b], grad_scale=coef,
                                       decay=1.0 - lr * wd, beta1=b1, beta2=b2,
                                       bias_correction2_sqrt=math.sqrt(bc2), eps=float(self.cfg.eps),
                                       step_size=lr / bc1, threads=self.threads, **cut)
            if k == len(ranges) - 1:
                setattr(s, mark, step)
            yield {"adamw": loop_s, "call": _beyond(t0, loop_s)}

    def sqnorm(self, t: torch.Tensor) -> float:
        return self._loops.sqnorm(t.reshape(-1), self.threads) if t.dtype in self._loops.dtypes else super().sqnorm(t)

    def accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.dtype == torch.float32:
            acc.add_(grad)
        else:
            t0 = time.perf_counter()
            self.sum_call_s += _beyond(t0, self._loops.accumulate(acc, grad, self.threads))

    def accumulate_pair(self, acc: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, init: bool) -> None:
        if g0.dtype == g1.dtype != torch.float32:  # one pass: 12 B per parameter against 20 for two
            t0 = time.perf_counter()
            self.sum_call_s += _beyond(t0, self._loops.accumulate_pair(acc, g0, g1, self.threads, init))
        else:
            super().accumulate_pair(acc, g0, g1, init)

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def self_check(self) -> None:
        """Compare two updates of ``2**16 + 5`` elements (several threads' parts) with
        ``torch.optim.AdamW``; raise RuntimeError if they differ beyond rounding."""
        n = (1 << 16) + 5
        with _disable_current_modes():
            gen = torch.Generator().manual_seed(0)
            master = torch.randn(n, generator=gen)
            ref = master.clone()
            grad = torch.randn(n, generator=gen).to(torch.bfloat16)
            s = UnitShadow(None, master.to(torch.bfloat16), master, torch.zeros(n), torch.zeros(n), grad, grad, None, [])
            opt = torch.optim.AdamW([ref], lr=self.lr, betas=self.cfg.betas, eps=self.cfg.eps,
                                    weight_decay=self.cfg.weight_decay)
            for _ in range(2):
                self.apply(s, 1.0)
                ref.grad = grad.float()
                opt.step()
            s.step = 0
        if not torch.allclose(master, ref, rtol=1e-5, atol=1e-6) or not torch.equal(s.work, master.to(torch.bfloat16)):
            raise RuntimeError("the single-pass host AdamW disagrees with torch.optim.AdamW on this machine")


def make_host_kernel(kind: str, cfg: AdamW, shadows: list[UnitShadow]) -> HostKernel:
    """The host kernel ``kind`` (one of :data:`KERNELS`) for the host-homed ``shadows``.

    Raises:
        ValueError: unknown ``kind``.
        RuntimeError: ``"single-pass"`` asked for explicitly and it cannot be built here.
    """
    if kind not in KERNELS:
        raise ValueError(f"unknown host kernel {kind!r}; valid: {', '.join(KERNELS)}")
    if kind == "torch" or not shadows:
        return TorchKernel(cfg, shadows)
    try:
        kernel = SinglePassKernel(cfg, shadows)
        kernel.self_check()
        return kernel
    except Exception as exc:  # no C compiler, a dtype it lacks, or wrong results
        if kind == "single-pass":
            raise RuntimeError(f"the single-pass host AdamW kernel could not be built here: {exc}; "
                               "use host_kernel='torch'") from exc
        _log.warning("MemFerry: single-pass host AdamW unavailable (%s: %s); using torch's fused AdamW in three passes",
                     type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return TorchKernel(cfg, shadows)
