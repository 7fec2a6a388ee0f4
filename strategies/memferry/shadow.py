"""The shadow model: every parameter's homes, on the host and on the device, as flat buffers.

Per unit, in pinned host memory (the backend's arena):
    ``work``    the compute-dtype copy the device reads (by copy or DHA); updated in place by
                the optimizer, so the next forward reads new weights with no upload phase;
    ``master``  fp32 weights the optimizer updates (the same buffer as ``work`` when the
                compute dtype is fp32);
    ``exp_avg``, ``exp_avg_sq``  fp32 Adam moments;
    ``grad_stage``  the compute-dtype landing zone of the gradient (device→host copy or DHA
                write); ``grad`` is the same buffer: the host kernel upcasts it chunk by
                chunk into a small fp32 scratch (``host_kernel.py``), so no whole fp32
                gradient is kept (16 bytes per parameter in all for bf16: work, master,
                two moments, gradient).
Frozen parameters (``requires_grad=False``) sit after the trainable ones in the unit's flat
``work`` (and device buffer) and have no master, moments or gradient: those buffers cover the
trainable prefix only. With gradient accumulation, ``grad_acc`` (fp32, this rank's shard) sums
the micro-batches' gradients of one step; a unit summed in pairs (``paired``) has a second
landing zone, ``grad_stage2``, so two micro-batches are summed in one pass (12 bytes per
parameter moved instead of 20).
On the device, one flat compute-dtype buffer per unit whose storage is given back between
uses (``free_storage``); the unit's ``nn.Parameter`` objects are views into it (or into the
device view of ``work`` for DHA), so autograd and user code keep seeing ordinary parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from xpu import Backend
from xpu.arena import HostArena
from xpu.hostmem import mem_available

from .data_parallel import DataParallel
from .shadow_sizing import backup_elements, host_bytes_needed, splits, train_part
from .units import Unit

__all__ = ["UnitShadow", "ShadowModel"]

#: The optimizer state of a trainable parameter, besides its step count.
_STATE = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class UnitShadow:
    """Host and device buffers of one unit, and the parameters' places in them."""

    unit: Unit
    work: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    grad_stage: torch.Tensor
    device_flat: torch.Tensor
    offsets: list[int]
    shard: slice | None = None
    home: str = "host"
    step: int = 0
    dha_flat: torch.Tensor | None = None
    device_views: list[torch.Tensor] = field(default_factory=list)
    dha_views: list[torch.Tensor] = field(default_factory=list)
    #: fp32 sum of the micro-batches' gradients of one step (gradient accumulation; None
    #: without it); ``accumulated`` says whether the next update reads it.
    grad_acc: torch.Tensor | None = None
    accumulated: bool = False
    #: the second landing zone of a unit whose micro-batches are summed two at a time (None: one zone)
    grad_stage2: torch.Tensor | None = None
    #: a split update's fp32 gradient of the step, kept from its first pass to its second
    #: (``split_update.py``; None: the unit's updates never split)
    grad_pending: torch.Tensor | None = None
    #: the step whose working copy a split update's first pass has written
    copied: int = 0
    #: the step's last two micro-batches wait in both zones, not summed: the update adds them as
    #: it reads them (``LandingZones(fuse_last_pair=True)``, :attr:`grad_terms`)
    last_pair: bool = False
    #: the step's last micro-batch waits in this zone (0, 1), not summed: the update adds it to
    #: ``grad_acc`` as it reads them (``LandingZones(fuse_last_pair=True)``); None: not so
    last_alone: int | None = None

    @property
    def grad_source(self) -> torch.Tensor:
        """The gradient the next update reads: the accumulated sum when there is one, else the landed one."""
        return self.grad_acc if self.accumulated and self.grad_acc is not None else self.grad_stage

    @property
    def grad_terms(self) -> tuple[torch.Tensor, ...]:
        """What the next update sums, left to right in fp32, for its gradient: ``(grad_source,)``;
        with :attr:`last_pair`, ``(grad_stage, grad_stage2)``, after ``grad_acc`` when earlier
        micro-batches were summed into it; with :attr:`last_alone`, ``grad_acc`` and that zone."""
        if self.last_alone is not None:
            return (self.grad_acc, self.grad_stage2 if self.last_alone else self.grad_stage)
        if not self.last_pair:
            return (self.grad_source,)
        pair = (self.grad_stage, self.grad_stage2)
        return (self.grad_acc, *pair) if self.accumulated else pair

    @property
    def master_is_work(self) -> bool:
        """Whether the fp32 master is (a view of) the working copy: fp32 compute."""
        return self.master.dtype == self.work.dtype and self.master.data_ptr() == self.train_work.data_ptr()

    @property
    def train_shard(self) -> slice | None:
        """This rank's part of the trainable prefix under data parallelism (None alone): its
        load shard cut at the end of the trainable parameters, as frozen ones have no optimizer
        state (they sit after the trainable ones, and every rank's copy of them stays whole)."""
        if self.shard is None:
            return None
        return train_part(self.shard, self.unit.train_numel)

    @property
    def train_work(self) -> torch.Tensor:
        """The part of the working copy this rank's optimizer state covers (its trainable shard)."""
        return self.work[self.train_shard] if self.shard is not None else self.work[: self.master.numel()]

    @property
    def decay_end(self) -> int:
        """Where, in this rank's optimizer state, the weight-decay group ends (the rest decays not)."""
        if self.unit is None:
            return self.master.numel()
        start = self.train_shard.start if self.shard is not None else 0
        return min(max(self.unit.decay_numel - start, 0), self.master.numel())

    def write_back(self) -> None:
        """Copy the updated master into this rank's part of the compute-dtype working copy."""
        if not self.master_is_work:
            self.train_work.copy_(self.master)

    def train_slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each trainable parameter (a gradient or optimizer buffer)."""
        return [flat[o:o + p.numel()].view(p.shape) for o, (_, p) in zip(self.offsets, self.unit.trainable)]

    @property
    def nbytes_work(self) -> int:
        """Bytes of the compute-dtype copy (what one load moves)."""
        return self.work.numel() * self.work.element_size()

    def slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        return [flat[o:o + p.numel()].view(p.shape) for o, (_, p) in zip(self.offsets, self.unit.params)]

    def bind(self, views: list[torch.Tensor]) -> None:
        """Point every parameter of the unit at ``views`` (its data, not its identity)."""
        for (_, p), v in zip(self.unit.params, views):
            p.data = v


class ShadowModel:
    """Homes of every unit's parameters; see the module docstring.

    Args:
        units: from :func:`~strategies.memferry.units.split_units`, parameters still holding
            their initial values (on the host).
        backend: the xpu backend (its arena provides pinned memory).
        device: device index.
        device_homes: indices of units homed on the device instead: their weights, fp32
            master and moments live in device memory and the device updates them.
        dp: data-parallel set-up: host-homed units keep only this rank's shard of their
            master, moments and gradient.
        backup_budget: bytes of speculative clipping's backup arena (:attr:`backup`, see
            :func:`backup_elements`): 0 none, None as much as every host-homed unit needs,
            ``"auto"`` that but at most half the host memory the other buffers leave.
        paired: indices of host-homed units whose accumulated micro-batches land in two zones
            and are summed two at a time (``accumulation.paired_units``).
        kept: optimizer state kept through a rebuild (:meth:`optimizer_state_dict`'s form, from
            :meth:`release`): each unit's master, moments and step come from it as the unit is
            made, and its entries are dropped then (the caller's dict is this one), so the host
            never holds the whole state beside the finished shadows.
        split: with ``accumulate``, give each host-homed unit of 16-bit compute a buffer for its
            step's fp32 gradient between a split update's passes (``split_update.py``).
    """

    def __init__(self, units: list[Unit], backend: Backend, device: int, device_homes: set[int] | frozenset = frozenset(),
                 dp: "DataParallel | None" = None, originals: dict[str, torch.Tensor] | None = None,
                 accumulate: bool = False, backup_budget: int | str | None = 0,
                 paired: frozenset[int] = frozenset(), kept: dict[str, Any] | None = None,
                 split: bool = False) -> None:
        self.backend, self.device, self.dp = backend, device, dp
        self.split = split and accumulate
        self.paired = paired
        self.backup_budget = backup_budget
        self.accumulate = accumulate
        self.units = units
        # Parameters cast to the compute dtype by the engine: masters from these (fp32)
        # originals, and state dicts in their dtype.
        self._originals = originals if originals is not None else {}
        self.state_dtypes = {name: t.dtype for name, t in self._originals.items()}
        self._check_host_memory(device_homes)
        self.shadows: list[UnitShadow] = []
        for u in units:
            self.shadows.append(self._make_device_home(u) if u.index in device_homes else self._make(u))
            if kept:
                self._restore(self.shadows[-1], kept)
            # Taken as masters: let this unit's fp32 originals go now (the caller's dict is this
            # one), so the host never holds the whole fp32 model beside the finished shadows.
            for name, _ in u.params:
                self._originals.pop(name, None)
        # Speculative clipping's backups of masters and moments (host_optimizer.py): one flat fp32 arena.
        n_backup = backup_elements(units, device_homes, dp, self.backup_budget, self.split)
        #: fp32 backup arena for speculative clipping (empty without it).
        self.backup = backend.host_arena.empty(n_backup, torch.float32) if n_backup else torch.empty(0)

    def _room(self) -> tuple[int | None, str]:
        """Host bytes left for the shadow model (None: unknown) and what bounds them, for messages."""
        arena = self.backend.host_arena
        if arena.budget is not None:
            return arena.budget - arena.stats().in_use, "the pinned host-memory budget (XPU_HOST_MEM_BUDGET)"
        return mem_available(), "the host's available memory (MemAvailable)"

    def _check_host_memory(self, device_homes: set[int] | frozenset) -> None:
        """Refuse before allocating anything when the host buffers cannot all fit; resolve an
        ``"auto"`` backup budget to half the room the other buffers leave."""
        from xpu.errors import HostMemoryBudgetError
        from xpu.units import format_bytes

        room, what = self._room()
        if self.backup_budget == "auto":
            rest = host_bytes_needed(self.units, device_homes, self.dp, self.accumulate, paired=self.paired,
                                     split=self.split)
            self.backup_budget = None if room is None else max(0, (room - rest) // 2)
        need = host_bytes_needed(self.units, device_homes, self.dp, self.accumulate, self.backup_budget, self.paired,
                                 split=self.split)
        if room is None:
            return
        if need > room:
            backup = 4 * backup_elements(self.units, device_homes, self.dp, self.backup_budget, self.split)
            extra = (f", {format_bytes(backup)} of them speculative clipping's backups (AdamW clip_mode='wait' or a "
                     f"smaller clip_backup_bytes needs less)") if backup else ""
            raise HostMemoryBudgetError(
                f"the shadow model needs {format_bytes(need)} of pinned host memory (working copies, fp32 masters, "
                f"Adam moments, gradients of the host-homed units{extra}) but {what} leaves {format_bytes(room)}; "
                f"raise it, home more units on the device (plan deviceN), or train a smaller model")

    def _original(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The value a master starts from: the pre-cast original where there is one."""
        return self._originals.get(name, p).detach()

    def _make_device_home(self, unit: Unit) -> UnitShadow:
        b, dev = self.backend, self.device
        n, nt = unit.numel, unit.train_numel
        dtype = unit.params[0][1].dtype
        work = b.empty(n, dtype, dev)
        master = work[:nt] if dtype == torch.float32 else b.empty(nt, torch.float32, dev)
        offsets, o = [], 0
        for k, (name, p) in enumerate(unit.params):
            offsets.append(o)
            if k < len(unit.trainable):
                b.copy(master[o:o + p.numel()], self._original(name, p).reshape(-1).float())  # fp32 from the original
            else:  # frozen: only its working copy
                b.copy(work[o:o + p.numel()], p.detach().reshape(-1))
            o += p.numel()
        if dtype != torch.float32:
            work[:nt].copy_(master)
        exp_avg, exp_avg_sq = b.empty(nt, torch.float32, dev), b.empty(nt, torch.float32, dev)
        exp_avg.zero_()
        exp_avg_sq.zero_()
        grad = b.empty(nt, torch.float32, dev)
        b.free_storage(grad)  # memory only while an update runs (DeviceOptimizer)
        shadow = UnitShadow(unit, work, master, exp_avg, exp_avg_sq, grad, grad, work, offsets, home="device")
        shadow.device_views = shadow.slices(work)
        shadow.bind(shadow.device_views)
        return shadow

    def _make(self, unit: Unit) -> UnitShadow:
        b, arena = self.backend, self.backend.host_arena
        n = unit.numel
        dtype = unit.params[0][1].dtype if unit.params else torch.float32
        # Data parallel: this rank updates one shard of the (padded) flat unit; alone, the shard is everything.
        padded, shard = self.dp.shard(n) if self.dp is not None else (n, slice(0, unit.train_numel))
        mine = train_part(shard, unit.train_numel)  # the optimizer's part: frozen parameters have none
        size = mine.stop - mine.start

        def state(dt: torch.dtype) -> torch.Tensor:  # optimizer-side buffers: none for a frozen unit
            return arena.empty(size, dt) if size else torch.empty(0, dtype=dt)

        work = arena.empty(padded, dtype)
        work[n:].zero_()
        offsets, o = [], 0
        for _, p in unit.params:
            offsets.append(o)
            work[o:o + p.numel()].copy_(p.detach().reshape(-1))
            o += p.numel()
        if dtype == torch.float32:
            master = work[mine]  # the fp32 working copy is the master: no second copy to keep in step
        else:
            master = state(torch.float32)
            # fp32 from the original (not from work), straight in: a temporary is host-memory churn
            for off, (name, p) in zip(offsets, unit.trainable):
                lo, hi = max(off, mine.start), min(off + p.numel(), mine.stop)
                if lo < hi:
                    master[lo - mine.start:hi - mine.start].copy_(self._original(name, p).reshape(-1)[lo - off:hi - off])
        exp_avg, exp_avg_sq = state(torch.float32), state(torch.float32)
        exp_avg.zero_()
        exp_avg_sq.zero_()
        grad_stage = state(dtype)
        grad = grad_stage  # see the module docstring: upcast chunk-wise by the host kernel
        device_flat = b.empty(padded, dtype, self.device)
        shadow = UnitShadow(unit, work, master, exp_avg, exp_avg_sq, grad, grad_stage, device_flat, offsets, shard=shard)
        if self.accumulate and unit.trainable:
            # empty on a data-parallel rank whose shard holds no trainable parameter: it still takes part
            shadow.grad_acc = state(torch.float32)
            if unit.index in self.paired:
                shadow.grad_stage2 = state(dtype)
            if self.split and splits(unit):
                shadow.grad_pending = state(torch.float32)
        shadow.device_views = shadow.slices(device_flat)
        if b.caps.dha:
            shadow.dha_flat = b.device_view(work, self.device)
            shadow.dha_views = shadow.slices(shadow.dha_flat)
        b.free_storage(device_flat)
        shadow.bind(shadow.device_views)
        return shadow

    def release(self, keep_weights: bool = False, keep_optimizer: bool = False) -> dict[str, Any]:
        """Give every host buffer back to the arena and free the device memory of every unit's
        device copy and device-homed state (the engine is closing): now, not when a garbage
        collection reaches the engine's reference cycles (hooks, views, the model's parameters),
        which held a closed engine's device memory for as long as none ran.

        ``keep_weights`` / ``keep_optimizer``: return ``{"model": ..., "optimizer": ...}`` as
        :meth:`state_dict` and :meth:`optimizer_state_dict` have them, taken unit by unit, each
        unit's host buffers freed right after (returned to the system, not kept in the arena's
        cache), so the host never holds the copy beside the whole shadow. Copied first, the 26 GB
        of a 6.6 B model's fp32 weights beside its 100 GB shadow passed its 120 GB host cap when a
        re-plan rebuilt the engine (H100, 2026-12-05). The pages go back only where nothing else
        holds the buffers: the engine drops its optimizers and executor first. Otherwise ``{}``."""
        self.backend.synchronize(self.device)  # nothing queued may still read what is freed here
        arena = self.backend.host_arena
        free = keep_weights or keep_optimizer
        state: dict[str, Any] = {}
        if keep_weights:
            state["model"] = {}
        if keep_optimizer:
            state["optimizer"] = {}
        shadows, self.shadows = list(self.shadows), []  # others may hold the list itself: not emptied
        for k in range(len(shadows)):
            if keep_weights:
                state["model"].update(self._weights(shadows[k], copy=True))
            if keep_optimizer:
                state["optimizer"].update(self._optimizer_state(shadows[k], copy=True))
            self._release_unit(shadows[k], arena, free=free)
            shadows[k] = None  # type: ignore[call-overload]  # its views were the last references
        if self.backup.numel():
            (arena.free if free else arena.release)(self.backup)
            self.backup = torch.empty(0)
        return state

    def _release_unit(self, s: UnitShadow, arena: HostArena, free: bool) -> None:
        """Free ``s``'s device memory; its host buffers back to ``arena`` (``free``: to the system)."""
        on_device = [s.device_flat]
        if s.home == "device":
            on_device += [s.master, s.grad_stage, s.work, s.exp_avg, s.exp_avg_sq, s.grad, s.grad_acc, s.grad_stage2,
                          s.grad_pending]
        for t in {t.untyped_storage().data_ptr(): t for t in on_device if t is not None}.values():
            self.backend.free_storage(t)
        s.dha_flat, s.dha_views = None, []
        if s.home != "host":
            return
        # Aliases (an fp32 master inside the working copy, fp32 gradients staged in place)
        # share one arena buffer: release each storage once.
        held = (s.master, s.grad_stage, s.work, s.exp_avg, s.exp_avg_sq, s.grad, s.grad_acc, s.grad_stage2,
                s.grad_pending)
        buffers = {t.untyped_storage().data_ptr(): t for t in held if t is not None and t.numel()}
        for t in buffers.values():
            (arena.free if free else arena.release)(t)

    # ------------------------------------------------------------------ checkpoints
    def _full(self, s: UnitShadow, key: str) -> torch.Tensor:
        """The whole flat fp32 ``master``/``exp_avg``/``exp_avg_sq`` of a unit (shards gathered)."""
        part = getattr(s, key)
        if s.home == "device" or self.dp is None:
            return part
        full = torch.zeros(s.work.numel(), dtype=torch.float32)
        full[s.train_shard].copy_(part)
        self.dp.gather(full)  # a collective: every rank is here too
        return full

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter as an ordinary host tensor of its own dtype (the dtype before the
        engine's ``compute_dtype`` cast, where there was one), from the fp32 master.

        ``copy=False``: where a parameter's host buffer already has its dtype, a view of it (live:
        the next update changes it), for a caller that writes the state out at once.
        Data parallel: a collective (every rank must call it); each rank gets the whole state.
        """
        return {name: t for s in self.shadows for name, t in self._weights(s, copy).items()}

    def _weights(self, s: UnitShadow, copy: bool) -> dict[str, torch.Tensor]:
        """Unit ``s``'s part of :meth:`state_dict`."""
        master = self._full(s, "master")
        n_train = len(s.unit.trainable)
        out = {}
        for k, (off, (name, p)) in enumerate(zip(s.offsets, s.unit.params)):
            src = master if k < n_train else s.work  # frozen: the working copy is all there is
            out[name] = src[off:off + p.numel()].view(p.shape).to("cpu", self.state_dtypes.get(name, p.dtype), copy=copy)
        return out

    def optimizer_state_dict(self, copy: bool = True) -> dict[str, object]:
        """fp32 master weights, Adam moments and step counts per parameter name (a collective
        under data parallelism, like :meth:`state_dict`; ``copy`` as there)."""
        return {name: st for s in self.shadows for name, st in self._optimizer_state(s, copy).items()}

    def _optimizer_state(self, s: UnitShadow, copy: bool) -> dict[str, object]:
        """Unit ``s``'s part of :meth:`optimizer_state_dict`."""
        state: dict[str, object] = {}
        full = {key: self._full(s, key) for key in _STATE}
        for off, (name, p) in zip(s.offsets, s.unit.trainable):
            sl = slice(off, off + p.numel())
            state[name] = {key: t[sl].view(p.shape).to("cpu", copy=copy) for key, t in full.items()} | {"step": s.step}
        return state

    def _restore(self, s: UnitShadow, kept: dict[str, Any]) -> None:
        """Unit ``s``'s master, moments and step from ``kept`` (see the constructor), and its
        working copy from that master, as :meth:`load` sets them; its entries are dropped."""
        entries = [(off, p, kept.pop(name)) for off, (name, p) in zip(s.offsets, s.unit.trainable) if name in kept]
        if not entries:
            return
        full = {key: torch.zeros(s.work.numel(), dtype=torch.float32) for key in _STATE}
        for off, p, st in entries:
            for key in _STATE:
                full[key][off:off + p.numel()].copy_(st[key].reshape(-1))
            s.step = int(st["step"])
        mine = s.train_shard if s.shard is not None else slice(0, s.master.numel())
        for key in _STATE:
            getattr(s, key).copy_(full[key][mine])
        n = s.unit.train_numel  # the trainable parameters come first in the flat unit
        s.work[:n].copy_(full["master"][:n])

    def load(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, object] | None = None) -> None:
        """Load weights (and optionally optimizer state); checks every name and shape first.

        Raises:
            KeyError: a parameter is missing from the state, or the state has unknown names.
            ValueError: a shape differs.
        """
        names = {name: p for s in self.shadows for name, p in s.unit.params}
        trained = {name for s in self.shadows for name, _ in s.unit.trainable}
        for label, state, expected in (("model", model_state, set(names)), ("optimizer", optimizer_state or {}, trained)):
            if not state:
                continue
            missing, unknown = expected - set(state), set(state) - expected
            if missing or unknown:
                raise KeyError(f"{label} state does not match the model: missing {sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}")
        for name, p in names.items():
            value = model_state.get(name)
            if value is not None and tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} in the state, {tuple(p.shape)} in the model")
        for s in self.shadows:
            length = s.work.numel()  # padded under data parallelism
            keys = _STATE if optimizer_state else ("master",)
            full = {key: torch.zeros(length, dtype=torch.float32) for key in keys}
            n_train = len(s.unit.trainable)
            for k, (off, (name, p)) in enumerate(zip(s.offsets, s.unit.params)):
                sl = slice(off, off + p.numel())
                if optimizer_state and k < n_train:
                    for key in keys:
                        full[key][sl].copy_(optimizer_state[name][key].reshape(-1))
                    s.step = int(optimizer_state[name]["step"])
                else:  # weights only, or a frozen parameter (no optimizer state)
                    full["master"][sl].copy_(model_state[name].reshape(-1))
            mine = s.train_shard if s.shard is not None else slice(0, s.master.numel())
            for key in keys:
                getattr(s, key).copy_(full[key][mine])
            s.work.copy_(full["master"])  # every rank's working copy is whole (frozen parameters included)
