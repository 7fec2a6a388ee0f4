"""A linear op whose weight lives in pinned host memory and crosses the host link once per use.

Why: reading a host weight in place (Direct Host Access, ``Backend.device_view``) is the
cheapest way to use it when the batch is small, but a GEMM reads its weight operand once per
tile of output rows, so at large M every byte crosses PCIe many times (H200, W 8192x8192
bf16: 2.66 ms at M=64 but 42 ms at M=4096, where copying first then computing takes 3.1 ms).
Copying the whole weight first fixes the traffic but costs the weight's size in device memory.
:func:`host_linear` picks per call:

``"dha"``     M <= ``dha_max_rows`` and ``caps.dha``: the GEMM reads the host weight in place
              (one M-tile, so each byte crosses once);
``"stream"``  otherwise: the weight goes through a ring of two device slots of ``chunk_bytes``
              each, row chunk by row chunk, copied on a copy stream while the compute stream
              multiplies the previous chunk. Each byte crosses once; device memory is two
              chunks, not the weight;
``"copy"``    no DHA and no asynchronous copies: one plain copy of the weight, then the GEMM
              (the ring would not overlap anything there).

Backward moves the weight once more (``dX = dY @ W``, streamed the same way: row chunk k of W
meets column chunk k of dY, ``dX = sum_k dY[:, rows_k] @ W_k``) and never holds a whole weight
gradient on the device when ``grad_out`` is given: ``dW = dY^T @ X`` is written straight into
that pinned host tensor, chunk by chunk, interleaved with the dX chunks (chunk k's gradient
rows go out while weight chunk k+1 comes in). In a streamed pass (and with
``grad_write="ring"``, or without ``caps.dha``) each chunk goes through a two-slot device ring
and a device->host copy stream; where the weight is read in place (``"dha"`` mode, or with
``grad_write="dha"``) the GEMM writes host memory through the device view.

Measured (H200, PCIe ~55 GB/s each way, W 8192x8192 bf16, ``bench/scripts/diag_dha_linear.py``):
forward 2.6-2.8 ms for M = 256..4096 (copy-then-GEMM 2.5-3.1 ms, cuBLAS on the DHA view 5-42
ms), 3.2 ms at M=16384 (copy-then-GEMM 5.2 ms). Backward with the ring: 3.1 ms at M=1024, 3.4
ms at 4096, 8.5 ms at 16384 (one weight in and its gradient out, largely overlapped); with the
DHA write instead 4.8, 5.0 and 10.3 ms (2026-12-01).

Ordering is by events only; the host never waits. Contracts for callers:

* ``weight_host`` is read until the compute stream passes this op's forward (and again its
  backward); do not update it in place before then (the memferry executor's host optimizer
  updates a unit only after its gradients landed, which is after its backward).
* ``grad_out`` is complete when the compute stream passes this op's backward; ``grad_ready``
  (if given) receives an event recorded right there, to wait on from the host (for example
  ``HostOptimizer.submit(index, event.synchronize)``). The event also certifies that the
  backward no longer reads ``weight_host``.
* When ``grad_out`` is given the op returns no gradient for the weight (autograd sees None), so
  post-accumulate-grad hooks on the weight do not fire: use ``grad_ready`` instead.
* ``grad_out`` is overwritten, not accumulated into.
* dX accumulates over chunks in the compute dtype (each chunk one fused ``addmm``, fp32 inside
  the GEMM); for 16-bit dtypes that is one rounding per chunk, not one in all.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xpu import Backend, CapabilityError, in_host_memory, triton_dha

__all__ = ["host_linear", "choose_mode", "TransferCounter", "DHA_MAX_ROWS", "CHUNK_BYTES", "MODES", "GRAD_WRITES", "KERNELS"]

#: Largest M (rows of the flattened input) read in place by DHA: one GEMM M-tile, so the
#: weight crosses the link once.
DHA_MAX_ROWS = 64
#: Default size of one ring slot. 8 MiB crosses a 55 GB/s link in ~0.15 ms: small enough that
#: the first, unoverlapped chunk costs little, large enough that each GEMM stays efficient.
CHUNK_BYTES = 8 << 20
#: Modes :func:`host_linear` accepts.
MODES = ("auto", "dha", "stream", "copy")
#: Ways :func:`host_linear` writes the weight gradient home (``grad_write``).
GRAD_WRITES = ("auto", "dha", "ring")
#: What :func:`host_linear` computes on host memory in place with (``kernels``).
KERNELS = ("auto", "torch", "triton")


@dataclass
class TransferCounter:
    """Bytes :func:`host_linear` moved over the host link, by way; add one to a call to count.

    Attributes:
        h2d_bytes: weight bytes copied host->device by the copy engine (ring or plain copy).
        d2h_bytes: gradient bytes copied device->host by the copy engine.
        dha_read_bytes: weight bytes a kernel read in place (one pass; DHA mode).
        dha_write_bytes: gradient bytes a kernel wrote in place (DHA).
        modes: calls per mode, forward and backward separately (``"stream/forward"``...).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    dha_read_bytes: int = 0
    dha_write_bytes: int = 0
    modes: dict[str, int] = field(default_factory=dict)

    def _note(self, mode: str, phase: str) -> None:
        key = f"{mode}/{phase}"
        self.modes[key] = self.modes.get(key, 0) + 1


def choose_mode(rows: int, backend: Backend, dha_max_rows: int = DHA_MAX_ROWS, mode: str = "auto") -> str:
    """The mode :func:`host_linear` runs for an input of ``rows`` rows (see the module docstring).

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
        CapabilityError: ``mode="dha"`` on a backend without ``caps.dha``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    caps = backend.caps
    if mode == "dha" and not caps.dha:
        raise CapabilityError(f"host_linear mode 'dha' needs Direct Host Access, which backend '{backend.name}' lacks "
                              f"(caps.dha is False); use mode='auto'")
    if mode != "auto":
        return mode
    if caps.dha and rows <= dha_max_rows:
        return "dha"
    if caps.dha or caps.async_copy:
        return "stream"
    return "copy"


def host_linear(x: torch.Tensor, weight_host: torch.Tensor, bias: torch.Tensor | None = None,
                backend: Backend | None = None, device: int | None = None, grad_out: torch.Tensor | None = None, *,
                weight: torch.Tensor | None = None, mode: str = "auto", dha_max_rows: int = DHA_MAX_ROWS,
                chunk_bytes: int = CHUNK_BYTES, grad_ready: Callable[[Any], None] | None = None,
                counter: TransferCounter | None = None, grad_write: str = "auto",
                kernels: str = "auto") -> torch.Tensor:
    """``F.linear(x, W, bias)`` where ``W`` (``weight_host``) lives in pinned host memory.

    Each weight byte crosses the host link once per forward and once per backward that needs
    ``dX``, for any batch size; see the module docstring for the modes and the contracts.

    Args:
        x: device input ``[..., in_features]``, the weight's dtype.
        weight_host: ``[out_features, in_features]``, contiguous, pinned host memory (from
            ``backend.host_arena`` or ``register_host``).
        bias: device ``[out_features]`` or None; its gradient is computed on the device.
        backend: the xpu backend (default ``xpu.get_backend()``).
        device: device index (default the current device).
        grad_out: optional pinned, contiguous host tensor shaped and typed like the weight: the
            weight gradient is written here (overwritten) and autograd gets None for the weight.
        weight: the tensor autograd treats as the weight (for example the module's
            ``nn.Parameter``, bound to a device view of ``weight_host``); its data is not read.
            Default ``weight_host``. When it requires grad and ``grad_out`` is None, its
            gradient is returned on the device, so it must be a device tensor.
        mode: ``"auto"`` (by M and the backend's capabilities), or force ``"dha"``,
            ``"stream"`` or ``"copy"``.
        dha_max_rows: the largest M that ``"auto"`` reads in place.
        chunk_bytes: size of one ring slot (rounded down to whole weight rows, at least one).
        grad_ready: called during backward with an event recorded on the compute stream once
            ``grad_out`` is written (only when ``grad_out`` is given).
        counter: a :class:`TransferCounter` to add this call's traffic to.
        grad_write: how ``grad_out`` is written: ``"dha"`` (the GEMM writes host memory through
            the device view), ``"ring"`` (the GEMM writes a two-slot device ring, a copy stream
            takes each chunk home), or ``"auto"``: ``"dha"`` where the weight is read in place
            (``"dha"`` mode), else ``"ring"``. On the H200 the ring held 92-96 % of the
            device->host line rate at M = 1024-8192, the DHA write 93-74 %
            (bench/results/2026-11-29-h200-session4/diag-dw-write.txt), and a streamed forward +
            backward ran 1.6-1.8 ms faster with the ring (2026-12-01).
        kernels: what computes on host memory in place (``"dha"`` mode, DHA gradient writes):
            ``"triton"`` (``xpu.triton_dha``: each host byte crosses once by construction,
            needs ``caps.triton``), ``"torch"`` (the vendor GEMM over the device view), or
            ``"auto"``: ``"triton"`` where ``caps.triton``.

    Returns:
        ``[..., out_features]`` on the device.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or placements (checked before any work).
        CapabilityError: ``mode="dha"`` or ``grad_write="dha"`` without ``caps.dha``;
            ``kernels="triton"`` without ``caps.triton``.
    """
    if backend is None:
        import xpu

        backend = xpu.get_backend()
    dev = backend.index_of(device)
    _check(x, weight_host, bias, backend, grad_out, weight, chunk_bytes, dha_max_rows)
    if grad_write not in GRAD_WRITES:
        raise ValueError(f"host_linear: grad_write must be one of {GRAD_WRITES}, got {grad_write!r}")
    if grad_write == "dha" and not backend.caps.dha:
        raise CapabilityError(f"host_linear grad_write 'dha' needs Direct Host Access, which backend '{backend.name}' "
                              f"lacks (caps.dha is False); use grad_write='auto' or 'ring'")
    if kernels not in KERNELS:
        raise ValueError(f"host_linear: kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "triton" and not backend.caps.triton:
        raise CapabilityError(f"host_linear kernels 'triton' needs Triton on backend '{backend.name}' (caps.triton is "
                              f"False: is the triton package installed?); use kernels='auto' or 'torch'")
    rows = x.numel() // weight_host.shape[1] if weight_host.shape[1] else 0
    chosen = choose_mode(rows, backend, dha_max_rows, mode)
    row_bytes = max(1, weight_host.shape[1] * weight_host.element_size())
    chunk_rows = weight_host.shape[0] if chosen == "copy" else max(1, min(weight_host.shape[0], chunk_bytes // row_bytes))
    # "auto" writes in place only where the weight is read in place too. A streamed pass takes
    # the gradient home through the ring: its device->host copies overlap the next weight chunk
    # coming in, and a whole forward + backward ran 1.6-1.8 ms faster per 8192x8192 weight than
    # with the DHA write at M = 1024..16384 (H200, bench/results/2026-12-01-h200-session5).
    dha_write = grad_write == "dha" or (grad_write == "auto" and backend.caps.dha and chosen == "dha")
    triton = kernels == "triton" or (kernels == "auto" and backend.caps.triton)
    cfg = _Config(backend, dev, weight_host, grad_out, chosen, max(1, chunk_rows), grad_ready, counter, dha_write, triton)
    autograd_weight = weight if weight is not None else weight_host
    return _HostLinear.apply(x, autograd_weight, bias, cfg)


# ---------------------------------------------------------------------- internals
@dataclass
class _Config:
    """What one call's forward and backward share besides autograd's tensors."""

    backend: Backend
    device: int
    weight_host: torch.Tensor
    grad_out: torch.Tensor | None
    mode: str
    chunk_rows: int
    grad_ready: Callable[[Any], None] | None
    counter: TransferCounter | None
    dha_write: bool
    triton: bool = False

    def read_once(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ b (+ bias)`` with ``b`` a device view of host memory, read in place (the
        vendor GEMM past the rows one Triton program holds: only a forced ``mode="dha"``)."""
        if self.triton and a.shape[0] <= triton_dha.MAX_ROWS:
            return triton_dha.mm_read_once(a, b, bias)
        return torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)

    def write_once(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """``out = a @ b`` with ``out`` a device view of host memory, written in place."""
        if self.triton:
            triton_dha.mm_write_once(a, b, out)
        else:
            torch.mm(a, b, out=out)


def _check(x: Any, w: Any, bias: Any, b: Backend, grad_out: Any, weight: Any, chunk_bytes: Any, dha_max_rows: Any) -> None:
    """Reject bad input before any copy or kernel is queued."""
    for name, t in (("x", x), ("weight_host", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"host_linear: {name} must be a tensor, got {type(t).__name__}")
    if w.dim() != 2:
        raise ValueError(f"host_linear: weight_host must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if x.dim() < 1 or x.shape[-1] != in_f:
        raise ValueError(f"host_linear: x's last dimension must be in_features={in_f} (weight {tuple(w.shape)}), "
                         f"got x of shape {tuple(x.shape)}")
    if not in_host_memory(w) or not b.is_pinned(w):
        raise ValueError("host_linear: weight_host must be pinned host memory (backend.host_arena.empty or "
                         f"register_host), got a {'device' if not in_host_memory(w) else 'pageable or device'} tensor")
    if not w.is_contiguous():
        raise ValueError("host_linear: weight_host must be contiguous (row chunks are copied as one block each)")
    if x.device.type != b.device_type:
        raise ValueError(f"host_linear: x must be on the {b.name} device, got a tensor on {x.device}")
    if x.dtype != w.dtype:
        raise TypeError(f"host_linear: x is {x.dtype} but weight_host is {w.dtype}; cast one to the compute dtype")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_f,):
            raise ValueError(f"host_linear: bias must be a tensor of shape ({out_f},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != w.dtype or bias.device.type != b.device_type:
            raise ValueError(f"host_linear: bias must be a {w.dtype} tensor on the {b.name} device, "
                             f"got {bias.dtype} on {bias.device}")
    if grad_out is not None:
        if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != tuple(w.shape) or grad_out.dtype != w.dtype:
            raise ValueError(f"host_linear: grad_out must be a {w.dtype} tensor of the weight's shape {tuple(w.shape)}, got "
                             + (f"{grad_out.dtype} {tuple(grad_out.shape)}" if isinstance(grad_out, torch.Tensor)
                                else type(grad_out).__name__))
        if not in_host_memory(grad_out) or not b.is_pinned(grad_out) or not grad_out.is_contiguous():
            raise ValueError("host_linear: grad_out must be contiguous pinned host memory (backend.host_arena.empty)")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(w.shape):
            raise ValueError(f"host_linear: weight must be a tensor of weight_host's shape {tuple(w.shape)}")
    stand_in = weight if weight is not None else w
    if stand_in.requires_grad and grad_out is None and stand_in.device.type != b.device_type:
        raise ValueError("host_linear: the weight requires grad but lives on the host and no grad_out is given, so its "
                         "gradient would land on the device; pass grad_out= (a pinned host gradient) or weight= (a device "
                         "tensor standing for it)")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"host_linear: chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    if not isinstance(dha_max_rows, int) or isinstance(dha_max_rows, bool) or dha_max_rows < 0:
        raise ValueError(f"host_linear: dha_max_rows must be a non-negative integer, got {dha_max_rows!r}")


# One host->device and one device->host copy stream per (backend, device): two directions so
# weight chunks in and gradient chunks out share the full-duplex link.
_STREAMS: "weakref.WeakKeyDictionary[Backend, dict[tuple[str, int], Any]]" = weakref.WeakKeyDictionary()


def _copy_stream(b: Backend, dev: int, direction: str) -> Any:
    streams = _STREAMS.setdefault(b, {})
    key = (direction, dev)
    if key not in streams:
        streams[key] = b.stream(dev)
    return streams[key]


def _bounds(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(r, min(r + chunk, rows)) for r in range(0, rows, chunk)]


def _stream_weight(cfg: _Config, consume: Callable[[int, int, torch.Tensor], None]) -> None:
    """Bring ``weight_host`` to the device in row chunks through two slots; call
    ``consume(r0, r1, chunk)`` on the compute stream once each chunk has landed.

    Events: chunk k is read only after its copy's event; slot k%2 is refilled only after the
    compute stream's event following ``consume`` of chunk k (the GEMM reading it).
    """
    b, dev, host = cfg.backend, cfg.device, cfg.weight_host
    compute, h2d = b.current_stream(dev), _copy_stream(b, dev, "h2d")
    bounds = _bounds(host.shape[0], cfg.chunk_rows)
    if not bounds:
        return
    n_slots = min(2, len(bounds))
    slot_rows = min(cfg.chunk_rows, host.shape[0])
    slots = [b.empty((slot_rows, host.shape[1]), host.dtype, dev) for _ in range(n_slots)]
    # The slots come from the compute stream's pool: memory freed there may still be read by
    # queued kernels, so the copy stream starts after the compute stream's work so far.
    allocated = b.event()
    allocated.record(compute)
    h2d.wait_event(allocated)
    ready: list[Any] = [None] * len(bounds)
    freed: list[Any] = [None] * n_slots

    def issue(k: int) -> None:
        slot = k % n_slots
        if freed[slot] is not None:
            h2d.wait_event(freed[slot])
        r0, r1 = bounds[k]
        b.copy(slots[slot][: r1 - r0], host[r0:r1], h2d)
        ready[k] = b.event()
        ready[k].record(h2d)

    for k in range(n_slots):
        issue(k)
    for k, (r0, r1) in enumerate(bounds):
        compute.wait_event(ready[k])
        consume(r0, r1, slots[k % n_slots][: r1 - r0])
        if k + n_slots < len(bounds):
            freed[k % n_slots] = b.event()
            freed[k % n_slots].record(compute)
            issue(k + n_slots)
    # Every copy is now ordered before the compute stream's next work, so the slots may go
    # back to the compute stream's pool when they fall out of scope (no keep_alive needed).
    if cfg.counter is not None:
        cfg.counter.h2d_bytes += host.numel() * host.element_size()


class _GradWriter:
    """Writes ``dW[r0:r1] = dY[:, r0:r1]^T @ X`` into ``grad_out``, chunk by chunk.

    With ``cfg.dha_write`` the GEMM writes host memory through the device view (each byte
    once). Otherwise each chunk lands in one of two device slots and a device->host copy stream
    takes it home; :meth:`finish` makes the compute stream wait for the last copies, so that
    ``grad_out`` is complete once the compute stream passes that point.
    """

    def __init__(self, cfg: _Config, dy: torch.Tensor, x: torch.Tensor) -> None:
        self.cfg, self.dy, self.x = cfg, dy, x
        b, dev, g = cfg.backend, cfg.device, cfg.grad_out
        self.compute = b.current_stream(dev)
        self.dha = cfg.dha_write
        if self.dha:
            self.view = b.device_view(g, dev)
        else:
            self.d2h = _copy_stream(b, dev, "d2h")
            rows = min(cfg.chunk_rows, g.shape[0])
            self.slots = [b.empty((rows, g.shape[1]), g.dtype, dev) for _ in range(min(2, max(1, -(-g.shape[0] // rows))))]
            self.landed: list[Any] = [None] * len(self.slots)
            self.k = 0

    def write(self, r0: int, r1: int) -> None:
        """Queue rows ``r0:r1`` of the gradient on the compute stream (in slot-sized pieces
        through the ring: a whole in-place-mode gradient is more rows than one slot)."""
        if self.dha:
            self.cfg.write_once(self.dy[:, r0:r1].t(), self.x, self.view[r0:r1])
            return
        for a, z in _bounds(r1 - r0, self.slots[0].shape[0]):
            self._ring(r0 + a, r0 + z)

    def _ring(self, r0: int, r1: int) -> None:
        b, i = self.cfg.backend, self.k % len(self.slots)
        self.k += 1
        if self.landed[i] is not None:  # the slot's previous chunk must be home before it is overwritten
            self.compute.wait_event(self.landed[i])
        slot = self.slots[i][: r1 - r0]
        torch.mm(self.dy[:, r0:r1].t(), self.x, out=slot)
        computed = b.event()
        computed.record(self.compute)
        self.d2h.wait_event(computed)
        b.copy(self.cfg.grad_out[r0:r1], slot, self.d2h)
        self.landed[i] = b.event()
        self.landed[i].record(self.d2h)

    def finish(self) -> None:
        """Order the compute stream after the last copies; count the bytes."""
        g = self.cfg.grad_out
        nbytes = g.numel() * g.element_size()
        if not self.dha:
            for event in self.landed:
                if event is not None:
                    self.compute.wait_event(event)
        counter = self.cfg.counter
        if counter is not None:
            if self.dha:
                counter.dha_write_bytes += nbytes
            else:
                counter.d2h_bytes += nbytes


class _HostLinear(torch.autograd.Function):
    """Autograd of :func:`host_linear`; ``weight`` is only autograd's handle on the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: _Config) -> torch.Tensor:
        b, dev, w = cfg.backend, cfg.device, cfg.weight_host
        out_f, in_f = w.shape
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x)
        if cfg.counter is not None:
            cfg.counter._note(cfg.mode, "forward")
        with b.device_scope(dev):
            x2d = x.reshape(-1, in_f)
            if cfg.mode == "dha":
                y = cfg.read_once(x2d, b.device_view(w, dev).t(), bias)
                if cfg.counter is not None:
                    cfg.counter.dha_read_bytes += w.numel() * w.element_size()
            else:
                y = b.empty((x2d.shape[0], out_f), w.dtype, dev)

                def gemm(r0: int, r1: int, chunk: torch.Tensor) -> None:
                    # A column block of y is a valid strided GEMM output (ld = out_features).
                    if bias is None:
                        torch.mm(x2d, chunk.t(), out=y[:, r0:r1])
                    else:
                        torch.addmm(bias[r0:r1], x2d, chunk.t(), out=y[:, r0:r1])

                _stream_weight(cfg, gemm)
            return y.view(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cfg: _Config = ctx.cfg
        b, dev, w = cfg.backend, cfg.device, cfg.weight_host
        (x,) = ctx.saved_tensors
        out_f, in_f = w.shape
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if cfg.counter is not None:
            cfg.counter._note(cfg.mode, "backward")
        with b.device_scope(dev):
            dy = grad_y.reshape(-1, out_f)
            x2d = x.reshape(-1, in_f)
            writer = _GradWriter(cfg, dy, x2d) if cfg.grad_out is not None else None
            if cfg.mode == "dha":
                if need_dx:
                    dx = cfg.read_once(dy, b.device_view(w, dev))
                    if cfg.counter is not None:
                        cfg.counter.dha_read_bytes += w.numel() * w.element_size()
                if writer is not None:
                    writer.write(0, out_f)
            elif need_dx:
                dx = b.empty((dy.shape[0], in_f), w.dtype, dev)
                first = [True]

                def gemm(r0: int, r1: int, chunk: torch.Tensor) -> None:
                    if first[0]:
                        torch.mm(dy[:, r0:r1], chunk, out=dx)
                        first[0] = False
                    else:
                        dx.addmm_(dy[:, r0:r1], chunk)
                    if writer is not None:  # this chunk's dW rows go out while the next W chunk comes in
                        writer.write(r0, r1)

                _stream_weight(cfg, gemm)
            elif writer is not None:
                for r0, r1 in _bounds(out_f, cfg.chunk_rows):
                    writer.write(r0, r1)
            if writer is not None:
                writer.finish()
            elif need_dw:
                dw = torch.mm(dy.t(), x2d)
            if need_db and ctx.has_bias:
                db = dy.sum(0)
            if dx is not None:
                dx = dx.view(x.shape)
            if writer is not None and cfg.grad_ready is not None:
                ready = b.event()
                ready.record(b.current_stream(dev))
                cfg.grad_ready(ready)
        return dx, dw, db, None
