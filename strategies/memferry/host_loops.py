"""The host optimizer's elementwise loops in C: AdamW in one pass, fp32 accumulation.

Why C through ``ctypes`` and not ``torch.compile``: Inductor's compiled CPU kernels hold the
GIL for their whole run (its Python binding never releases it), so a host update of tens of
milliseconds on the optimizer's worker thread stopped the training thread from issuing device
work: on the H200 machine (2026-12-02, bench/results/2026-12-02-h200-session9/) the compiled
single pass made the 17-layer starved step 0.174 s against 0.119 s for torch's ops, which
release the GIL. A ``ctypes`` call releases it for its whole duration.

``host_loops.c`` is built once per machine (``c_library.py``: ``-O3 -march=native``, no FMA
contraction beyond the one ATen's lerp has), cached, and loaded once per process. Its loops
split a range over ``threads`` POSIX threads (no OpenMP: a second OpenMP runtime beside torch's
would fight it for the cores).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from xpu.hostmem import in_host_memory

from .c_library import CLibrary, UnavailableError

__all__ = ["HostLoops", "host_loops", "clear_cache", "UnavailableError"]

_SOURCE = Path(__file__).with_name("host_loops.c")
_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11"]
_ATTEMPTS = [["-march=native"], ["-march=native", "-DXPU_NO_F16"], [], ["-DXPU_NO_F16"]]
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class HostLoops:
    """The built loops, loaded (one instance per process: :func:`host_loops`).

    Every tensor must be a contiguous host tensor; a range is processed in place by up to
    ``threads`` threads, with the GIL released.
    """

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.xpu_adamw.argtypes = [c_int, c_int, p, p, p, p, p, i64, ctypes.POINTER(ctypes.c_float), c_int,
                                  c_int, p, p, p, p, p, ctypes.POINTER(ctypes.c_double)]
        lib.xpu_adamw.restype = c_int
        lib.xpu_sqnorm.argtypes = [c_int, p, i64, c_int, p, ctypes.POINTER(ctypes.c_double)]
        lib.xpu_sqnorm.restype = c_int
        seconds = ctypes.POINTER(ctypes.c_double)
        lib.xpu_accumulate.argtypes = [c_int, p, p, i64, c_int, seconds]
        lib.xpu_accumulate.restype = c_int
        lib.xpu_accumulate2.argtypes = [c_int, p, p, p, i64, c_int, c_int, seconds]
        lib.xpu_accumulate2.restype = c_int
        lib.xpu_has_f16.restype = c_int
        self._lib, self.path = lib, path
        self.dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if lib.xpu_has_f16() else ())

    def _kind(self, t: torch.Tensor, what: str) -> int:
        if t.dtype not in self.dtypes:
            raise ValueError(f"{what}: dtype {t.dtype} is not built here; built: {', '.join(map(str, self.dtypes))}")
        return _KIND[t.dtype]

    @staticmethod
    def _check(tensors: dict[str, torch.Tensor | None], n: int) -> None:
        for what, t in tensors.items():
            if t is None:
                continue
            if not in_host_memory(t) or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"{what} must be a contiguous host tensor of {n} elements, got "
                                 f"{tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")

    def adamw(self, master: torch.Tensor, grad: torch.Tensor | tuple[torch.Tensor, ...], exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, work: torch.Tensor | None, *, grad_scale: float, decay: float, beta1: float,
              beta2: float, bias_correction2_sqrt: float, eps: float, step_size: float, threads: int,
              save: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              copy_first: bool = False, grad_out: torch.Tensor | None = None) -> float:
        """One AdamW step in place over fp32 ``master``/moments, ``grad`` of any built dtype, and
        (unless None) the ``work`` copy written from the updated master.

        ``grad`` may also be a step's last two micro-batches, summed as the sweep reads them and
        in the order :meth:`accumulate_pair` adds them (bit-equal to summing first): ``(g0, g1)``
        for ``g0 + g1``, or ``(acc, g0, g1)`` for ``(acc + g0) + g1`` with ``acc`` the fp32 sum
        of the micro-batches before (read, not written); or ``(acc, g)`` for ``acc + g``, as
        :meth:`accumulate` adds them.
        ``decay`` is ``1 - lr * weight_decay`` and ``step_size`` ``lr / bias_correction1``; each
        scalar is rounded to fp32 once, as torch's ops round their Python-float arguments.
        ``save``: fp32 (master, exp_avg, exp_avg_sq) to receive the old values in the same sweep;
        ``source``: read the old values from these instead (restore and update in one sweep).
        ``copy_first``: write only ``work`` and (unless None) the whole fp32 gradient to
        ``grad_out``, not the master and moments: the first pass of a split update, whose second
        is this update in place from ``grad_out`` with no ``work`` (bit-equal to one pass).

        Returns the seconds the loop ran, clocked inside the call: what the call takes beyond
        them is its Python side and taking the GIL back (``SinglePassKernel``'s ``call`` phase).
        """
        n = master.numel()
        if save is not None and source is not None:
            raise ValueError("adamw takes save or source, not both")
        terms = grad if isinstance(grad, tuple) else (grad,)
        if len(terms) not in (1, 2, 3):
            raise ValueError(f"grad must be a tensor, (g0, g1), (acc, g) or (acc, g0, g1); got {len(terms)} tensors")
        if len(terms) > 1 and (save is not None or source is not None):
            raise ValueError("an update from a pair of micro-batches takes no save or source")
        one_more = len(terms) == 2 and terms[0].dtype == torch.float32 != terms[1].dtype  # (acc, g)
        acc = terms[0] if len(terms) == 3 or one_more else None
        g0, g1 = (terms[1], None) if one_more else (terms[-2], terms[-1]) if len(terms) > 1 else (terms[0], None)
        if copy_first and (save is not None or source is not None or work is None):
            raise ValueError("a copy-first pass writes the working copy (give work) and takes no save or source")
        if grad_out is not None and not copy_first:
            raise ValueError("grad_out is written by a copy-first pass only (copy_first=True)")
        backup = save if save is not None else source
        tensors = {"master": master, "grad": g0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "work": work,
                   "last grad": g1, "acc": acc, "grad_out": grad_out}
        if backup is not None:
            tensors.update(zip(("backup master", "backup exp_avg", "backup exp_avg_sq"), backup))
        self._check(tensors, n)
        for what, t in tensors.items():
            if t is not None and what not in ("grad", "work", "last grad") and t.dtype != torch.float32:
                raise ValueError(f"{what} must be fp32, got {t.dtype}")
        if g1 is not None and g1.dtype != g0.dtype:
            raise ValueError(f"a pair of micro-batches must share a dtype, got {g0.dtype} and {g1.dtype}")
        hp = (ctypes.c_float * 8)(grad_scale, decay, 1.0 - beta1, beta2, 1.0 - beta2, bias_correction2_sqrt, eps,
                                  -step_size)
        wkind = -1 if work is None else self._kind(work, "work")
        form = (8 if one_more else 3 if acc is not None else 4 if g1 is not None else 0 if backup is None
                else 1 if save is not None else 2)
        bp, bm, bv = (t.data_ptr() for t in backup) if backup is not None else (0, 0, 0)
        if copy_first:  # forms 5-7 and 9: 0, 3, 4 and 8 copying first; the gradient goes where a backup's master would
            form, bp = {0: 5, 3: 6, 4: 7, 8: 9}[form], 0 if grad_out is None else grad_out.data_ptr()
        seconds = ctypes.c_double()
        rc = self._lib.xpu_adamw(self._kind(g0, "grad"), wkind, master.data_ptr(), g0.data_ptr(),
                                 exp_avg.data_ptr(), exp_avg_sq.data_ptr(), 0 if work is None else work.data_ptr(),
                                 n, hp, int(threads), form, bp, bm, bv, 0 if acc is None else acc.data_ptr(),
                                 0 if g1 is None else g1.data_ptr(), ctypes.byref(seconds))
        if rc != 0:
            raise ValueError(f"no AdamW loop for grad {g0.dtype} / work {None if work is None else work.dtype}")
        return seconds.value

    def accumulate(self, acc: torch.Tensor, grad: torch.Tensor, threads: int) -> float:
        """``acc += grad`` in place: fp32 ``acc``, a 16-bit ``grad`` read once (no fp32 temporary).
        Returns the loop's seconds, clocked inside the call (as :meth:`adamw`)."""
        self._check({"acc": acc, "grad": grad}, acc.numel())
        if acc.dtype != torch.float32 or grad.dtype == torch.float32:
            raise ValueError(f"accumulate sums a 16-bit gradient into fp32, got {grad.dtype} into {acc.dtype}")
        seconds = ctypes.c_double()
        if self._lib.xpu_accumulate(self._kind(grad, "grad"), acc.data_ptr(), grad.data_ptr(), acc.numel(),
                                    int(threads), ctypes.byref(seconds)) != 0:
            raise ValueError(f"no accumulation loop for {grad.dtype}")
        return seconds.value


    def accumulate_pair(self, acc: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor, threads: int,
                        init: bool) -> float:
        """``acc = g0 + g1`` (``init``) or ``acc = (acc + g0) + g1`` in one pass: fp32 ``acc``, two
        16-bit gradients of one dtype, added in the order two :meth:`accumulate` calls would.
        Returns the loop's seconds, clocked inside the call (as :meth:`adamw`)."""
        self._check({"acc": acc, "g0": g0, "g1": g1}, acc.numel())
        if acc.dtype != torch.float32 or g0.dtype != g1.dtype or g0.dtype == torch.float32:
            raise ValueError(f"accumulate_pair sums two 16-bit gradients of one dtype into fp32, got {g0.dtype} and "
                             f"{g1.dtype} into {acc.dtype}")
        seconds = ctypes.c_double()
        if self._lib.xpu_accumulate2(self._kind(g0, "grad"), acc.data_ptr(), g0.data_ptr(), g1.data_ptr(), acc.numel(),
                                     int(threads), int(init), ctypes.byref(seconds)) != 0:
            raise ValueError(f"no accumulation loop for {g0.dtype}")
        return seconds.value

    def sqnorm(self, grad: torch.Tensor, threads: int) -> float:
        """The sum of ``grad``'s squares in fp64: in fixed 65536-element blocks added in order, so
        the same for any ``threads`` (the clip coefficient must not depend on the thread count)."""
        n = grad.numel()
        self._check({"grad": grad}, n)
        part = torch.empty(max(1, -(-n // 65536)), dtype=torch.float64)
        out = ctypes.c_double()
        if self._lib.xpu_sqnorm(self._kind(grad, "grad"), grad.data_ptr(), n, int(threads), part.data_ptr(),
                                ctypes.byref(out)) != 0:
            raise ValueError(f"no norm loop for {grad.dtype}")
        return out.value


_LIBRARY = CLibrary(_SOURCE, _FLAGS, _ATTEMPTS, HostLoops, libs=["-lm"])


def host_loops() -> HostLoops:
    """The loops, built on first use and shared by the process; raises :class:`UnavailableError`
    (remembering why) where they cannot be built."""
    return _LIBRARY.get()


def clear_cache() -> None:
    """Forget the loaded loops and any remembered failure (tests that simulate another machine)."""
    _LIBRARY.clear()
