"""Direct Host Access matmuls in Triton, tiled so that host memory crosses the link once.

Why: over a ``Backend.device_view`` of pinned host memory, a vendor GEMM picks its own tiling
and reads an operand once per tile of the other one (cuBLAS on the H200: 13x slower than
copy-then-GEMM at M = 4096, docs/design.md §3). These kernels fix the tiling instead:

* :func:`mm_read_once` computes ``C = A @ B`` for a short ``A`` (at most :data:`MAX_ROWS` rows,
  in device memory) and a ``B`` that may be host memory. One program owns a column block of
  ``C`` and every row of ``A``, so each element of ``B`` is loaded by exactly one program, once.
* :func:`mm_write_once` computes ``C = A @ B`` into a ``C`` that may be host memory. Each
  program writes its tile once, straight over the link, and no device buffer holds the result.

Both accumulate in fp32 and round once to ``C``'s dtype; fp32 operands multiply in full fp32
(not TF32), as torch's matmuls do by default. Triton is imported on first use, so this module
imports anywhere. A backend with ``Capabilities.triton`` runs them compiled on its devices; with
``TRITON_INTERPRET=1`` set before triton is first imported, the same code runs on CPU tensors in
Triton's interpreter (the tests do). ``host_linear`` (``strategies/memferry/dha_linear.py``)
uses them where it computes on host memory in place and ``caps.triton`` holds. On the H200 they
run at parity with cuBLAS there (bench/results/2026-12-01-h200-session5, section 5).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

__all__ = ["available", "mm_read_once", "mm_write_once", "MAX_ROWS"]

#: Most rows of ``A`` that :func:`mm_read_once` holds in one program (its accumulator is
#: ``MAX_ROWS x BLOCK_N`` fp32).
MAX_ROWS = 128
# Tiles: 128 elements along a contiguous host dimension are 256 B of bf16 per access, which keeps
# PCIe read requests long; 64 x 128 tiles leave 128+ programs for an 8192-wide weight.
_BLOCK_N, _BLOCK_K = 64, 128
# mm_write_once: small tiles while the reduction is short (a few rows of tokens: the writes are
# the work), GEMM-sized ones past _LONG_K, where the tiles' compute must keep up with the link.
_WRITE_SHORT, _WRITE_LONG, _LONG_K = (64, 128, 32, 4), (128, 128, 64, 8), 512


def available() -> bool:
    """Whether the ``triton`` package can be imported here (it says nothing about a device)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mm(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
           HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(b_ptr + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return triton, mm


def _check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: needs A [M, K] and B [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{what}: A and B must share one of float16, bfloat16, float32; got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what}: A and B must be on one device (a host operand through Backend.device_view), "
                         f"got {a.device} and {b.device}")


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
            bm: int, bn: int, bk: int, grid: tuple[int, int], warps: int, stages: int) -> torch.Tensor:
    triton, mm = _kernel()
    m, k = a.shape
    n = b.shape[1]
    mm[grid](a, b, c, bias if bias is not None else c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
             c.stride(0), c.stride(1), HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return c


def mm_read_once(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)``, reading every element of ``b`` exactly once.

    Args:
        a: ``[M, K]`` with ``M <= MAX_ROWS``, any strides (device memory: read once per column
            block of the result).
        b: ``[K, N]``, any strides; typically a transposed ``device_view`` of a host weight.
        bias: optional ``[N]``, added in fp32 before the one rounding.
        out: optional ``[M, N]`` result tensor of ``a``'s dtype; new otherwise.

    Raises:
        ValueError, TypeError: shapes, dtypes or devices that do not fit (before any launch).
    """
    _check(a, b, "mm_read_once")
    m, n = a.shape[0], b.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"mm_read_once: A has {m} rows, more than MAX_ROWS={MAX_ROWS} fit one program; "
                         f"stream the weight through device memory instead (host_linear's ring)")
    if bias is not None and (bias.shape != (n,) or bias.dtype != a.dtype):
        raise ValueError(f"mm_read_once: bias must be [{n}] of {a.dtype}, got {tuple(bias.shape)} of {bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    bm = max(16, 1 << max(0, m - 1).bit_length())  # tl.dot needs 16 rows at least
    return _launch(a, b, out, bias, bm, _BLOCK_N, _BLOCK_K, (1, -(-n // _BLOCK_N)), 4, 3)


def mm_write_once(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b``, writing every element of ``out`` exactly once (``out`` may be a
    ``device_view`` of pinned host memory: the result goes straight over the link).

    Args:
        a: ``[M, K]``, any strides (e.g. ``dY.t()`` for a weight gradient).
        b: ``[K, N]``, any strides.
        out: ``[M, N]`` of ``a``'s dtype, any strides; overwritten.

    Raises:
        ValueError, TypeError: shapes, dtypes or devices that do not fit (before any launch).
    """
    _check(a, b, "mm_write_once")
    m, n = a.shape[0], b.shape[1]
    if out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"mm_write_once: out must be [{m}, {n}] of {a.dtype} on {a.device}, got "
                         f"{tuple(out.shape)} of {out.dtype} on {out.device}")
    bm, bn, bk, warps = _WRITE_LONG if a.shape[1] >= _LONG_K else _WRITE_SHORT
    return _launch(a, b, out, None, bm, bn, bk, (-(-m // bm), -(-n // bn)), warps, 3)
