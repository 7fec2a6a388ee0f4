"""Huawei Ascend NPUs through torch_npu (``torch.npu``) and CANN, with ``npu-smi`` for topology.

Status: NOT RUN ON ASCEND HARDWARE. No line of this file (nor of :mod:`backends.npu_topology`
and :mod:`backends.npu_hostreg`) has executed against a real NPU, a real torch_npu, a real
CANN runtime or a real ``npu-smi``. What has been checked, on a CPU-only machine, against
the recording stand-in ``tests/fake_torch_npu.py``:

* which ``torch.npu`` calls each verb makes and with which arguments (device index, stream
  priority, event timing flag, memory fraction and device, peer queries in both directions);
* the host-registration arithmetic (:mod:`backends.npu_hostreg` lists what);
* ``unavailable_reason`` for a missing torch_npu, zero devices and a non-ascending
  ``ASCEND_RT_VISIBLE_DEVICES``;
* that :meth:`NpuBackend.copy` (the base class's) is non-blocking only when every host side
  is pinned or registered here: on NPU a non-blocking copy from memory the runtime does
  not see as pinned silently synchronises the stream;
* the ``npu-smi`` topology parsing and remapping (:mod:`backends.npu_topology` lists the
  samples).

Things a first run on Ascend must confirm (each is an assumption written down where it is
used): that ``tensor.is_pinned()`` reports memory registered through ``npuHostRegister``;
that mmap'd memory registers with MAPPED on the host's kernel (CANN requires
``aclrtMallocHost`` memory on kernels <= 5.10, which would make :meth:`alloc_pinned` fall
back to torch's pinned allocator); that ``npu-smi`` lists devices in the runtime's logical
order; the device-name strings the nominal-rate table keys on; and every nominal rate.
Also unverified: that ``npuHostRegister``/``npuHostUnregister``, which bypass torch_npu's
task queue (``TASK_QUEUE_ENABLE``), are safely ordered with copies queued through it; this
backend assumes callers free or unregister memory only after the copies using it completed.

Device tensors come from ``torch.empty``, which torch_npu creates in the base ND format, so
copies to and from host buffers avoid the private-format (NZ/5HD) conversion paths.

Host memory: exact-size buffers are page-aligned anonymous mappings registered with
``torch.npu.npurt().npuHostRegister(ptr, size, ACL_HOST_REG_MAPPED)`` (``aclrtHostRegisterV2``),
so they are DMA-fast and never rounded up to a power of two as torch_npu's caching host
allocator does. ``npurt`` exists only on torch_npu master and some dev branches (not the
``v2.x.0-26.x.0`` release branches), so without it buffers come from
``torch.empty(..., pin_memory=True)``.

Direct Host Access (``caps.dha``, :meth:`NpuBackend.device_view`) is granted only when
vllm-ascend's ``torch.ops._C_ascend.get_npu_view_from_cpu_tensor`` is registered in this
process; see :meth:`NpuBackend.dha_routes` for exactly what is checked.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import torch

from backends.npu_hostreg import HostRegistrations
from backends.npu_topology import VISIBLE_ENV, build_topology, visible_devices
from xpu.backend import Backend, MemoryStats, check_copy_pairs
from xpu.capabilities import Capabilities
from xpu.errors import CapabilityError, XpuError
from xpu.hostmem import mapped_buffer
from xpu.stream_pools import StreamPool, by_stream
from xpu.topology import Topology

__all__ = ["NpuBackend"]

_log = logging.getLogger("xpu")

_ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"


# ---------------------------------------------------------------------------- small helpers
def _npu() -> Any:
    """``torch.npu`` as torch_npu installs it (looked up late: this module imports without it)."""
    return torch.npu  # type: ignore[attr-defined]


def _pinned_by_torch(nbytes: int) -> torch.Tensor:
    """A pinned uint8 host tensor from torch_npu's caching host allocator.

    The tensor has exactly ``nbytes`` elements, but the allocator may reserve more behind it
    (it rounds blocks up, to a power of two below ``pinned_max_round_threshold_mb`` on
    torch_npu >= 26.2), so host memory use can exceed what the arena counts.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _vllm_ascend_view_op() -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """vllm-ascend's ``get_npu_view_from_cpu_tensor`` op if registered in this process, else None.

    Only looked up, never imported: importing ``vllm_ascend`` has side effects this library
    should not trigger. Import ``vllm_ascend.vllm_ascend_C`` before the backend's caps are
    first read to enable it.
    """
    return getattr(torch.ops._C_ascend, "get_npu_view_from_cpu_tensor", None)


def _alloc_conf_has_pinned_register() -> bool:
    """Whether ``PYTORCH_NPU_ALLOC_CONF`` contains ``pinned_mem_register:True``."""
    for item in os.environ.get(_ALLOC_CONF_ENV, "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "pinned_mem_register" and value.strip().lower() == "true":
            return True
    return False


# ---------------------------------------------------------------------------- the backend
class NpuBackend(Backend):
    """Huawei Ascend NPUs through torch_npu; see the module docstring for what is verified."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = VISIBLE_ENV

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None if torch_npu sees at least one NPU, else a sentence saying what is missing.

        Imports torch_npu (which registers the ``npu`` device type but initialises no
        device) and asks for the device count, which torch_npu answers from the HAL without
        starting the ACL runtime.
        """
        try:
            import torch_npu  # noqa: F401  -- imported for its side effect: it registers torch.npu
        except Exception as exc:  # ImportError, or OSError from a missing CANN library
            return (f"torch_npu could not be imported ({type(exc).__name__}: {exc}); install torch_npu "
                    f"matching torch {torch.__version__} and source the CANN set_env.sh")
        if not hasattr(torch, "npu"):
            return "torch_npu was imported but did not install torch.npu; check that its version matches torch"
        _, why = visible_devices()
        if why is not None:
            return why
        npu = _npu()
        if not npu.is_available() or npu.device_count() == 0:
            visible = os.environ.get(VISIBLE_ENV)
            hint = f" ({VISIBLE_ENV}={visible!r})" if visible is not None else ""
            return f"torch_npu sees no NPU{hint}: check the driver and devices with 'npu-smi info'"
        return None

    def __init__(self) -> None:
        super().__init__()
        self._host_regs = HostRegistrations()
        self._mmap_register_ok = True  # False after the first failed mapped registration
        self._topology: Topology | None = None

    # ------------------------------------------------------------------ capabilities
    def dha_routes(self) -> dict[str, str | None]:
        """For each way to build a device view of host memory: None if usable, else why not.

        * ``"vllm_ascend_op"``: ``torch.ops._C_ascend.get_npu_view_from_cpu_tensor`` is
          registered (``hasattr`` on the op namespace; vllm-ascend's C extension must have
          been imported). It calls ``aclrtHostGetDevicePointer`` and builds an NPU tensor
          whose deleter keeps the CPU tensor alive. This is the route ``device_view`` uses.
        * ``"npurt_pinned_register"``: ``hasattr(torch.npu, "npurt")``, ``PYTORCH_NPU_ALLOC_CONF``
          contains ``pinned_mem_register:True`` (pinned blocks are then registered MAPPED) and
          ``torch.npu.npurt()`` has a device-pointer getter (``npuHostGetDevicePointer``).
          Reported for diagnosis but never usable here: even with the pointer, torch_npu
          has no Python constructor for an NPU tensor over a foreign address that keeps the
          host memory alive, so this route never sets ``caps.dha``.
        """
        routes: dict[str, str | None] = {}
        routes["vllm_ascend_op"] = None if _vllm_ascend_view_op() is not None else (
            "torch.ops._C_ascend.get_npu_view_from_cpu_tensor is not registered (import vllm_ascend.vllm_ascend_C first)")
        npu = _npu()
        if not hasattr(npu, "npurt"):
            routes["npurt_pinned_register"] = "torch.npu.npurt is absent in this torch_npu build"
        elif not _alloc_conf_has_pinned_register():
            routes["npurt_pinned_register"] = f"{_ALLOC_CONF_ENV} does not contain pinned_mem_register:True"
        elif not hasattr(npu.npurt(), "npuHostGetDevicePointer"):
            routes["npurt_pinned_register"] = "torch.npu.npurt() exposes no device-pointer getter (aclrtHostGetDevicePointer)"
        else:
            routes["npurt_pinned_register"] = "prerequisites present, but no Python way to build an owning NPU tensor; unused"
        return routes

    def _detect_caps(self) -> Capabilities:
        """Capabilities from what torch_npu exposes here (see :meth:`dha_routes` for DHA).

        ``peer_access`` needs one pair that can reach each other both ways
        (``can_device_access_peer(a, b)`` and ``(b, a)``): torch_npu enables peer access on
        both sides or not at all. ``ipc`` stays False: whether ``torch.npu.Event`` and
        tensors can be shared across processes on a given CANN is unverified.

        The peer queries talk to the runtime, so in a process that forks workers read
        ``caps`` after the fork: torch_npu cannot re-initialise in a forked child.
        """
        npu = _npu()
        n = self.device_count()
        peer = any(npu.can_device_access_peer(a, b) and npu.can_device_access_peer(b, a)
                   for a in range(n) for b in range(a + 1, n))
        return Capabilities(dha=self.dha_routes()["vllm_ascend_op"] is None, peer_access=peer, ipc=False,
                            async_copy=True, host_register=hasattr(npu, "npurt"), timing_events=True)

    # ------------------------------------------------------------------ identity
    def device_count(self) -> int:
        """Number of NPUs torch_npu sees (after ``ASCEND_RT_VISIBLE_DEVICES``)."""
        return int(_npu().device_count())

    def current_device(self) -> int:
        """Index of the current NPU (``torch.npu.current_device``)."""
        return int(_npu().current_device())

    def device_scope(self, index: Any) -> contextlib.AbstractContextManager:
        """Context in which NPU ``index`` is current (``torch.npu.device``)."""
        return _npu().device(self.index_of(index))

    def bind_process(self, index: Any) -> None:
        """Make NPU ``index`` this process's current device (``torch.npu.set_device``; HCCL stages on it)."""
        _npu().set_device(self.index_of(index))

    # ------------------------------------------------------------------ streams and events
    def stream(self, device: Any = None, priority: int = 0) -> Any:
        """A new ``torch.npu.Stream`` on ``device``; lower ``priority`` numbers run first.

        The device goes in as an index: torch_npu's Stream enters ``torch.npu.device(index)``
        itself, and an index needs no ``npu`` device type registered to be built.
        """
        return _npu().Stream(device=self.index_of(device), priority=priority)

    def current_stream(self, device: Any = None) -> Any:
        """The stream work is queued on now for ``device`` (``torch.npu.current_stream``)."""
        return _npu().current_stream(self.index_of(device))

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (``torch.npu.stream``)."""
        return _npu().stream(stream)

    def event(self, timing: bool = False, blocking: bool = False) -> Any:
        """A new ``torch.npu.Event``; ``timing=True`` enables ``elapsed_time``, ``blocking=True``
        makes ``synchronize`` sleep instead of spin."""
        return _npu().Event(enable_timing=timing, blocking=blocking)

    def synchronize(self, device: Any = None) -> None:
        """Block until all work queued on ``device`` has finished (``aclrtSynchronizeDevice``)."""
        _npu().synchronize(self.index_of(device))

    # ------------------------------------------------------------------ host memory
    def _npurt(self) -> Any:
        """``torch.npu.npurt()``, or CapabilityError where this torch_npu lacks it."""
        npu = _npu()
        if not hasattr(npu, "npurt"):
            raise CapabilityError(
                "this torch_npu has no torch.npu.npurt() (it is on torch_npu master and some dev branches, not the "
                "v2.x.0-26.x.0 release branches), so host memory cannot be registered in place; use alloc_pinned or host_arena"
            )
        return npu.npurt()

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of exactly ``nbytes`` bytes, as a uint8 CPU tensor.

        With ``npurt``: a page-aligned anonymous mapping of ``nbytes`` bytes, registered
        MAPPED over its 4 KiB-padded span; unregistered by :meth:`free_pinned` or when the
        buffer is garbage-collected. If that registration fails once (CANN on host kernels
        <= 5.10 accepts only ``aclrtMallocHost`` memory), this and later calls fall back,
        with one warning, to torch_npu's pinned allocator, which may round the block up.
        Without ``npurt``: torch_npu's pinned allocator directly.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"alloc_pinned needs a non-negative size, got {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if not hasattr(_npu(), "npurt") or not self._mmap_register_ok:
            return _pinned_by_torch(nbytes)
        # An anonymous mapping is page-aligned, so no two buffers share a page and each can
        # be registered and unregistered on its own.
        mapping, buf = mapped_buffer(nbytes)  # huge pages unless XPU_HOST_HUGEPAGES=0, faulted in
        try:
            self._host_regs.register(buf, self._npurt(), owner=mapping)
        except XpuError as exc:
            self._mmap_register_ok = False
            _log.warning("xpu npu: %s; falling back to torch_npu's pinned allocator, which may round buffers up", exc)
            return _pinned_by_torch(nbytes)
        return buf

    def free_pinned(self, buffer: torch.Tensor) -> None:
        """Unregister a buffer from :meth:`alloc_pinned` now (no-op for torch-allocated ones).

        The memory itself is unmapped once the last view of it is gone. Call it only after
        every copy that uses the buffer has completed (an event on the copy's stream): the
        unregistration is a raw runtime call, not ordered with work queued on streams.
        """
        self._host_regs.release(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def register_host(self, tensor: torch.Tensor) -> None:
        """Page-lock and device-map an existing contiguous host tensor in place.

        Registers the 4 KiB-aligned span around the tensor with ``npuHostRegister(start,
        padded_size, ACL_HOST_REG_MAPPED)``; the registration is undone by
        :meth:`unregister_host` or when the tensor's storage is garbage-collected. No-op for
        tensors torch already pins and for memory inside an earlier registration.

        Raises:
            CapabilityError: this torch_npu has no ``npurt``.
            ValueError: not a contiguous CPU tensor, or its page span partly overlaps an
                earlier registration (neighbouring small tensors share pages; register the
                enclosing buffer once instead).
            XpuError: ``npuHostRegister`` returned an error code.
        """
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("register_host needs a contiguous host tensor")
        self._npurt()  # the capability check comes before any other outcome
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.is_pinned() or self._host_regs.covers(tensor.data_ptr(), nbytes):
            return
        self._host_regs.register(tensor, self._npurt())

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host` for this tensor; call before its memory is freed.

        Call it only after every copy that uses the tensor has completed. No-op for a
        tensor this backend did not register (a view inside a registered buffer, say).

        Raises:
            CapabilityError: this torch_npu has no ``npurt``.
            XpuError: ``npuHostUnregister`` returned an error code (the pages stay
                registered and the registration is kept on record).
        """
        self._npurt()
        self._host_regs.release(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def copy_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any = None) -> None:
        """:meth:`copy` of each pair, in one stream context. Not one ``_foreach_copy_``: whether
        torch_npu's (aclnn ForeachCopy, documented for Atlas A2 and not A3) takes host targets
        beside device sources is unverified; a copy per tensor is what :meth:`copy` does."""
        check_copy_pairs(dsts, srcs)
        with self.use_stream(stream) if stream is not None else contextlib.nullcontext():
            for dst, src in zip(dsts, srcs):
                self.copy(dst, src)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory this backend registered or torch_npu pinned.

        Registered ranges are checked first because whether ``Tensor.is_pinned()`` reports
        ``npuHostRegister``'d memory is unverified; :meth:`copy` relies on this answer, and
        on NPU a non-blocking copy from memory the runtime does not see as pinned silently
        synchronises.
        """
        if tensor.device.type != "cpu":
            return False
        nbytes = tensor.numel() * tensor.element_size()
        return self._host_regs.covers(tensor.data_ptr(), nbytes) or tensor.is_pinned()

    def device_view(self, host_tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        """An NPU tensor aliasing pinned, device-mapped ``host_tensor`` (no copy).

        Uses vllm-ascend's ``get_npu_view_from_cpu_tensor`` on ``device`` (made current for
        the call); the view's deleter keeps ``host_tensor`` alive. The mapped address is for
        kernel access only: CANN documents that it "cannot be used for memory operations
        such as memcpy", so do not ``copy_`` into or out of the view; use :meth:`copy` on
        the host tensor. Each kernel access crosses the host link.

        Raises:
            CapabilityError: ``caps.dha`` is false (the message lists what is missing).
            ValueError: ``host_tensor`` is not pinned host memory, or it is pinned but not
                device-mapped (register it with :meth:`register_host`, allocate it with
                :meth:`alloc_pinned`, or set ``pinned_mem_register:True``).
        """
        if not self.caps.dha:
            routes = "; ".join(f"{k}: {v}" for k, v in self.dha_routes().items() if v is not None)
            raise CapabilityError(
                f"backend 'npu' has no Direct Host Access here (caps.dha is False: {routes}); copy the tensor to the "
                f"device with copy()/to_device() instead"
            )
        index = self.index_of(device)
        if host_tensor.device.type != "cpu" or not self.is_pinned(host_tensor):
            raise ValueError("device_view needs pinned host memory; allocate it from host_arena or register_host it first")
        if host_tensor.untyped_storage().nbytes() == 0:
            return torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device(index))
        op = _vllm_ascend_view_op()
        with self.device_scope(index):
            view = op(host_tensor)
        if view is None:
            raise ValueError(
                "host memory is pinned but not device-mapped: register it with register_host (MAPPED), allocate it "
                "with alloc_pinned, or set PYTORCH_NPU_ALLOC_CONF=pinned_mem_register:True before pinning"
            )
        return view

    # ------------------------------------------------------------------ peers
    def can_access_peer(self, a: Any, b: Any) -> bool:
        """Whether NPUs ``a`` and ``b`` can reach each other directly, checked in both directions.

        torch_npu enables peer access on both sides together, so a one-way answer is no use.
        """
        a, b = self.index_of(a), self.index_of(b)
        npu = _npu()
        return a != b and bool(npu.can_device_access_peer(a, b)) and bool(npu.can_device_access_peer(b, a))

    def enable_peer_access(self, a: Any, b: Any) -> bool:
        """Report whether ``a`` and ``b`` can use peer access; nothing is enabled explicitly.

        torch_npu enables it lazily, on both sides, at the first cross-device ``copy_``
        (``aclrtDeviceEnablePeerAccess``). Before A3 a device can enable at most 8 peers;
        beyond that torch_npu logs an error and copies without P2P.
        """
        return self.can_access_peer(a, b)

    # ------------------------------------------------------------------ memory
    def _raw_mem_info(self, index: int) -> tuple[int, int]:
        """Device-wide ``(free, total)`` from ``aclrtGetMemInfo(ACL_HBM_MEM)``."""
        free, total = _npu().mem_get_info(index)
        return int(free), int(total)

    def memory_stats(self, device: Any = None) -> MemoryStats:
        """This process's allocator figures, asked of ``torch.npu`` directly.

        Older torch_npu may not route ``torch.accelerator.memory`` to its allocator.
        """
        i = self.index_of(device)
        npu = _npu()
        counters = getattr(npu, "memory_stats", None)  # absent from older torch_npu
        return MemoryStats(int(npu.memory_allocated(i)), int(npu.memory_reserved(i)),
                           int(npu.max_memory_allocated(i)), int(npu.max_memory_reserved(i)),
                           int(counters(i).get("num_alloc_retries", 0)) if counters else 0)

    def reset_peak_memory(self, device: Any = None) -> None:
        """Start the peaks of :meth:`memory_stats` afresh."""
        _npu().reset_peak_memory_stats(self.index_of(device))

    def reserved_by_stream(self, device: Any = None,
                           streams: Mapping[str, Any] | None = None) -> dict[str, StreamPool]:
        """From ``torch.npu.memory_snapshot()``, whose segments name their stream by its
        ``aclrtStream`` handle (a ``torch.npu.Stream``'s ``npu_stream``); empty where this
        torch_npu has no snapshot."""
        snapshot = getattr(_npu(), "memory_snapshot", None)
        if snapshot is None:
            return {}
        names = {s.npu_stream: name for name, s in (streams or {}).items() if hasattr(s, "npu_stream")}
        return by_stream(snapshot(), self.index_of(device), names)

    def release_cache(self, device: Any = None) -> None:
        """``torch.npu.empty_cache()`` on ``device`` (asked of ``torch.npu``, as :meth:`memory_stats` is)."""
        with self.device_scope(device):
            _npu().empty_cache()

    def _apply_memory_cap(self, index: int, nbytes: int | None) -> None:
        """``torch.npu.set_per_process_memory_fraction(nbytes / total, index)``.

        The total is ``mem_get_info``'s, because torch_npu multiplies the fraction by the
        total it reads from ``aclrtGetMemInfo(ACL_HBM_MEM)``.
        """
        total = self._raw_mem_info(index)[1]
        _npu().set_per_process_memory_fraction(1.0 if nbytes is None else nbytes / total, index)

    # ------------------------------------------------------------------ topology
    def topology(self) -> Topology:
        """Devices from ``torch.npu.get_device_properties``, links from ``npu-smi info -t topo``.

        See :func:`backends.npu_topology.build_topology`: host links and peer rates are
        nominal, and without a usable npu-smi the result has devices and host links only,
        with ``source`` saying why. Computed once per process.
        """
        if self._topology is None:
            npu = _npu()
            self._topology = build_topology([npu.get_device_properties(i) for i in range(self.device_count())])
        return self._topology

    # ------------------------------------------------------------------ misc
    def describe(self) -> dict[str, Any]:
        """The base summary plus how DHA and host registration were decided."""
        out = super().describe()
        out["dha_routes"] = self.dha_routes()
        out["npurt"] = hasattr(_npu(), "npurt")
        out[_ALLOC_CONF_ENV] = os.environ.get(_ALLOC_CONF_ENV)
        return out
