"""MemFerry's settings: the optimizer and the per-unit execution plan."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["AdamW", "UnitPlan", "Plan", "MODES", "OFFLOAD_MIN_BYTES", "MIN_HOST_PIECE", "CLIP_MODES"]

#: How host updates meet global-norm clipping (``AdamW.clip_mode``).
CLIP_MODES = ("speculative", "wait")

#: Where a unit's weights are read from during a pass:
#: ``resident``: a device copy kept between steps (refreshed after each update);
#: ``prefetch``: copied to the device ahead of use on a copy stream, freed after use;
#: ``dha``: kernels read the pinned host copy directly (no device memory, link-bound).
MODES = ("resident", "prefetch", "dha")
#: Saved tensors below this size stay on the device under activation offload (moving them costs
#: more than it frees); the executor's swapper and the profiler's count of what stays share it.
OFFLOAD_MIN_BYTES = 1 << 16
#: The least ``AdamW.host_piece``: below it a call's fixed cost outweighs its loop.
MIN_HOST_PIECE = 1 << 16
Mode = Literal["resident", "prefetch", "dha"]


@dataclass(frozen=True)
class AdamW:
    """AdamW settings, as ``torch.optim.AdamW`` takes them (decoupled weight decay).

    Attributes:
        lr: learning rate.
        betas: moment decay rates.
        eps: denominator term.
        weight_decay: decoupled weight decay, applied to every parameter.
        max_grad_norm: clip the global gradient 2-norm to this (None: no clipping). The clip
            coefficient needs every gradient; see ``clip_mode`` for how updates meet that.
        clip_mode: with ``max_grad_norm``: ``"speculative"`` (default) updates each host-homed
            unit as its gradient lands, as if no clip fired, after backing up its fp32 master and
            moments; a step whose norm turns out above ``max_grad_norm`` restores the backups and
            re-applies with the true coefficient (a rollback: exact, bit-equal to ``"wait"``).
            ``"wait"`` holds every host update until backward has ended.
        clip_backup_bytes: pinned host memory for ``"speculative"``'s backups (12 bytes per
            host-updated parameter; int or a size such as ``"8GB"``); units landing once it is
            full wait as in ``"wait"``. None: enough for every host-updated unit (refused when
            it does not fit). ``"auto"``: that, but at most half the host memory the shadow
            model's other buffers leave.
        host_threads: CPU threads of the host optimizer (None: torch's intra-op default).
            Its OpenMP team waits for its slowest thread, so a team that shares a core with
            the training thread (busy launching kernels) runs at that core's pace.
        host_kernel: how host updates run: ``"torch"`` (upcast, torch's fused AdamW, write
            back: three passes), ``"single-pass"`` (one C loop built with the machine's compiler,
            called with the GIL released) or ``"auto"`` (``single-pass`` where it builds and
            passes a check against ``torch.optim.AdamW``, else ``torch``; see ``host_kernel.py``).
        host_order: which landed gradient the host updates first: ``"deadline"`` (default: the
            unit the next forward needs first, an update under way yielding to a sooner one
            between pieces; ``host_tasks.py``) or ``"landing"`` (the order they land in, each
            update whole). The scheduler prices the order chosen. On the H200 (docs/design.md,
            session 17) deadline order took the 128-layer starved GPT to 1.47 s per step where
            landing order, before the loop's chunks, took 1.82; on §3 the two were within 1.3 %
            (0.1742 and 0.1720 s mean). Data parallelism always takes ``"landing"``.
        clip_fire_rate: with ``max_grad_norm``, the share of steps expected to clip (0 to 1). A
            step after a clipped one waits for every host update (they start only once the
            coefficient is known), so the scheduler picks the plan of least expected step over
            both kinds: fewer host-updated blocks, placed late in the model, where the clip fires
            often (``clip_plan.py``). 0 (default): plan for steps that do not clip.
        landing_wait: how the host optimizer's worker waits for a gradient copy to land:
            ``"spin"`` (default: the runtime's own wait, which may keep a core polling) or
            ``"sleep"`` (blocking-sync events: the worker sleeps until the copy ends). Inside
            steps a send of gradients home costs the training thread about three times what it
            costs alone (H200, session 25); a worker spinning beside it is one candidate.
        flat_sends: gather a unit's gradients on the device into one buffer and send that home
            in one copy, instead of a copy per tensor (``flat_sends.py``): the issuing thread's
            cost per send falls to about one copy's, for one unit's gradients of device memory
            more during backward (the scheduler counts them) and one fused device copy. Default
            False.
        split_update: under gradient accumulation, update each host-summed unit of 16-bit
            compute in two passes (``split_update.py``): the working copy first, which the next
            forward waits for (26 B a parameter after a last pair instead of 34), then the fp32
            master and moments while the next step's earlier micro-batches run. It keeps the
            step's fp32 gradient between them: 4 B a parameter more of pinned host memory. With
            speculative clipping the first pass is what speculates: it changes no state, so a
            step whose clip fires makes it again with the coefficient (22 B) instead of
            re-applying the whole update from a backup (28 B), and needs no backup. None (default):
            on where ``max_grad_norm`` is set and the single-pass loops build here
            (``split_update.updates_split``), off otherwise; on the HF model with accumulation 8
            and clipping it was 2-3 % faster on two H100 hosts, without clipping on the §3 GPT 1 %
            slower (bench/results/2026-12-06-h100-session40/). Read it as :attr:`splits`.
        host_piece: parameters per call of the single-pass loop (None: its 2**24, about 5 ms
            on an H200's host): the worker picks its next task between calls, so a unit the next
            forward needs sooner waits at most one piece; each call also takes the GIL back on
            its return, about 0.18 ms a call inside the 128-layer GPT's steps (H100, session 43:
            its ``call`` phase, 92 ms a step over 512 calls). At least 2**16.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    host_threads: int | None = None
    host_kernel: str = "auto"
    clip_mode: str = "speculative"
    host_order: str = "deadline"
    clip_backup_bytes: int | str | None = "auto"
    landing_wait: str = "spin"
    clip_fire_rate: float = 0.0
    flat_sends: bool = False
    split_update: bool | None = None
    host_piece: int | None = None

    @property
    def splits(self) -> bool:
        """Whether host updates split in two passes: :attr:`split_update`, where None means
        where clipping is (``max_grad_norm`` set)."""
        return self.max_grad_norm is not None if self.split_update is None else self.split_update

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"AdamW lr must be positive, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"AdamW needs eps > 0 and weight_decay >= 0, got eps={self.eps}, weight_decay={self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.host_threads is not None and (not isinstance(self.host_threads, int) or self.host_threads < 1):
            raise ValueError(f"host_threads must be a positive int or None, got {self.host_threads!r}")
        if self.host_kernel not in ("auto", "torch", "single-pass"):
            raise ValueError(f"host_kernel must be 'auto', 'torch' or 'single-pass', got {self.host_kernel!r}")
        if self.host_order not in ("deadline", "landing"):
            raise ValueError(f"host_order must be 'deadline' or 'landing', got {self.host_order!r}")
        if not 0 <= self.clip_fire_rate <= 1:
            raise ValueError(f"clip_fire_rate is a share of steps, from 0 to 1; got {self.clip_fire_rate!r}")
        if self.clip_fire_rate and self.max_grad_norm is None:
            raise ValueError(f"clip_fire_rate={self.clip_fire_rate} weighs steps whose clip fires, but max_grad_norm is "
                             f"None (no clipping): set max_grad_norm, or leave clip_fire_rate at 0")
        if self.split_update is not None and not isinstance(self.split_update, bool):
            raise ValueError(f"split_update must be True, False or None (on where clipping is), "
                             f"got {self.split_update!r}")
        if self.host_piece is not None and (not isinstance(self.host_piece, int) or isinstance(self.host_piece, bool)
                                            or self.host_piece < MIN_HOST_PIECE):
            raise ValueError(f"host_piece must be a whole number of parameters, at least {MIN_HOST_PIECE} "
                             f"(2**16), or None (the loop's 2**24); got {self.host_piece!r}")
        if not isinstance(self.flat_sends, bool):
            raise ValueError(f"flat_sends must be True or False, got {self.flat_sends!r}")
        if self.landing_wait not in ("spin", "sleep"):
            raise ValueError(f"landing_wait must be 'spin' or 'sleep', got {self.landing_wait!r}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be 'speculative' or 'wait', got {self.clip_mode!r}")
        self.backup_budget()  # refuses a bad size now

    def backup_budget(self) -> int | str | None:
        """``clip_backup_bytes`` in bytes (None: unbounded; ``"auto"`` as given)."""
        if self.clip_backup_bytes is None or self.clip_backup_bytes == "auto":
            return self.clip_backup_bytes
        from xpu.units import parse_bytes

        try:
            value = parse_bytes(self.clip_backup_bytes)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"clip_backup_bytes must be a byte count >= 0, a size such as '8GB', 'auto' or None, "
                             f"got {self.clip_backup_bytes!r}") from exc
        if value < 0:
            raise ValueError(f"clip_backup_bytes must be >= 0, got {self.clip_backup_bytes!r}")
        return value

    @property
    def speculative(self) -> bool:
        """Clipping is on and host updates run speculatively (see ``clip_mode``)."""
        return self.max_grad_norm is not None and self.clip_mode == "speculative"


@dataclass(frozen=True)
class UnitPlan:
    """How one unit runs.

    Attributes:
        forward: weight source in forward (see :data:`MODES`).
        backward: weight source in backward (and recomputation).
        recompute: drop the unit's activations after forward and recompute them in backward.
        selective: with ``recompute``, keep the outputs of the matrix multiplications and
            attention kernels (the expensive ops) and recompute only the cheap ops between them
            (norms, activation functions, residual adds): torch's selective activation
            checkpointing (:mod:`strategies.selective_recompute`). More bytes kept than full
            recompute, and less compute, but eager mode's per-op dispatch cost can outweigh
            that (bytes and times profiled per block).
        optimizer: ``"host"``: fp32 master and moments in host memory, updated by the CPU as
            gradients land; ``"device"``: they live on the device and the device updates the
            unit (needs a resident unit: 14 bytes per parameter of device memory for bf16
            weights, plus 4 per parameter of gradient while the unit's update runs).
        offload: copy the activations the unit saves for backward into pinned host memory
            during forward (on a side stream) and bring them back before its backward: the
            alternative to ``recompute`` when moving them costs less than recomputing them.
        accumulate: where a host-updated unit sums the micro-batches of a step under gradient
            accumulation (``MemFerry(accumulation_steps=N)``, N > 1). ``"host"``: every
            micro-batch's gradient goes home and the host adds it into an fp32 sum (2 bytes per
            parameter over the link and about 10 of host memory traffic each); ``"device"``: an
            fp32 device buffer (4 bytes per parameter, held from the step's first micro-batch
            to its last) sums them, and only the sum goes home, once (4 bytes per parameter):
            bit-equal to ``"host"``. Not for device-homed units (they sum on the device
            already) nor DHA ones (their weight gradients are written home by the device).
    """

    forward: Mode = "prefetch"
    backward: Mode = "prefetch"
    recompute: bool = False
    optimizer: Literal["host", "device"] = "host"
    offload: bool = False
    accumulate: Literal["host", "device"] = "host"
    selective: bool = False

    @property
    def activations(self) -> str:
        """What happens to the unit's saved activations: ``keep``, ``recompute``, ``selective`` or ``offload``."""
        if self.recompute:
            return "selective" if self.selective else "recompute"
        return "offload" if self.offload else "keep"

    def __post_init__(self) -> None:
        for phase in (self.forward, self.backward):
            if phase not in MODES:
                raise ValueError(f"unknown mode {phase!r}; modes are {', '.join(MODES)}")
        if (self.forward == "resident") != (self.backward == "resident"):
            raise ValueError("a resident unit is resident in both passes; give forward='resident', backward='resident'")
        if self.optimizer not in ("host", "device"):
            raise ValueError(f"optimizer must be 'host' or 'device', got {self.optimizer!r}")
        if self.offload and self.recompute:
            raise ValueError("a unit either recomputes its activations or offloads them, not both")
        if self.selective and not self.recompute:
            raise ValueError("selective=True chooses what recompute keeps: set recompute=True too")
        if self.selective and "dha" in (self.forward, self.backward):
            raise ValueError("selective recompute is for resident and prefetched units (a DHA unit's linears run as "
                             "host_linear, whose outputs the policy cannot keep): use recompute=True without selective")
        if self.optimizer == "device" and self.forward != "resident":
            raise ValueError("optimizer='device' keeps the unit's weights and states on the device: it needs a resident unit")
        if self.accumulate not in ("host", "device"):
            raise ValueError(f"accumulate must be 'host' or 'device', got {self.accumulate!r}")
        if self.accumulate == "device" and (self.optimizer == "device" or "dha" in (self.forward, self.backward)):
            raise ValueError("accumulate='device' is for host-updated units without DHA (a device-homed unit sums on "
                             "the device already; a DHA unit's weight gradients are written straight home): "
                             "leave accumulate='host'")


@dataclass
class Plan:
    """A plan for every block unit (the ``rest`` unit is always resident).

    Attributes:
        units: one :class:`UnitPlan` per block, in forward order.
        prefetch_depth: how many prefetch units may be in flight ahead of compute.
        rest_optimizer: where the ``rest`` unit (embeddings, final norm, head: always
            resident) is updated, ``"host"`` or ``"device"``; under gradient accumulation it
            sums its micro-batches there too.
        predicted_step_s: the scheduler's prediction, when it made the plan.
        host_s_per_param: the host AdamW rate (seconds per parameter) that prediction assumed,
            as profiled; the engine compares it with the rate its steps measure.
        host_earlier_s_per_param: the part of ``host_s_per_param`` spent summing a step's
            micro-batches before its last (0 without accumulation); the rehearsal compares each
            part with what it measures.
        rehearsed_step_s: the mean wall time of this layout's last rehearsal steps (real devices;
            None where not timed), beside ``predicted_step_s`` before training starts.
        notes: the scheduler's explanation lines.
        profile: the :class:`~strategies.memferry.profiler.StepProfile` the scheduler planned
            from (None for a plan not scheduled here), so the plan can be remade under another
            budget without profiling again (``planning.replan``).
        predicted_peak_bytes: the scheduler's predicted device peak (its margin included).
    """

    units: list[UnitPlan]
    prefetch_depth: int = 1
    rest_optimizer: Literal["host", "device"] = "host"
    predicted_step_s: float | None = None
    host_s_per_param: float | None = None
    notes: list[str] = field(default_factory=list)
    profile: Any = field(default=None, compare=False, repr=False)
    predicted_peak_bytes: int | None = None
    host_earlier_s_per_param: float | None = None
    rehearsed_step_s: float | None = None

    @property
    def host_update_s_per_param(self) -> float:
        """The part of ``host_s_per_param`` after a unit's last gradient has landed (the update,
        what the next forward may wait for); 0 for a plan the scheduler did not price."""
        return (self.host_s_per_param or 0.0) - (self.host_earlier_s_per_param or 0.0)

    @classmethod
    def uniform(cls, n_blocks: int, unit: UnitPlan | None = None, prefetch_depth: int = 1) -> "Plan":
        """The same plan for every block."""
        return cls([unit or UnitPlan()] * n_blocks, prefetch_depth)

    @classmethod
    def from_spec(cls, spec: str, n_blocks: int) -> "Plan":
        """A plan from a short name, as the CLI and benchmark options write it.

        ``prefetch`` / ``prefetchN`` (prefetch depth 1 / N), ``dha``, ``residentN`` (first N
        blocks resident, the rest prefetched), ``deviceN`` (first N blocks and the embeddings
        and head homed on the device with a device optimizer, the rest prefetched and updated
        on the host); any of them with ``+recompute``, ``+selective`` (recompute keeping the
        matmuls' outputs; not with ``dha``) or ``+offload`` (activations to host), then
        optionally ``+devacc``: every host-updated block sums accumulated micro-batches on the
        device (``UnitPlan.accumulate``; not with ``dha``). ``plan="auto"`` decides that per block.

        Raises:
            ValueError: an unknown name, or N outside ``0..n_blocks``.
        """
        if spec.endswith("+devacc"):
            base = cls.from_spec(spec[: -len("+devacc")], n_blocks)
            if any("dha" in (u.forward, u.backward) for u in base.units):
                raise ValueError(f"plan {spec!r}: +devacc sums gradients on the device, which DHA blocks cannot "
                                 f"(the device writes their weight gradients home); drop +devacc or use prefetch")
            base.units = [replace(u, accumulate="device") if u.optimizer == "host" else u for u in base.units]
            return base
        match = re.fullmatch(r"(prefetch|dha|resident|device)(\d*)(\+recompute|\+selective|\+offload)?", spec)
        kind, count, extra = (match.group(1), match.group(2), match.group(3) or "") if match else ("", "", "")
        sel = extra == "+selective"
        recompute, off = extra == "+recompute" or sel, extra == "+offload"
        prefetch = UnitPlan("prefetch", "prefetch", recompute, offload=off, selective=sel)
        if kind == "prefetch" and int(count or 1) >= 1:
            return cls([prefetch] * n_blocks, prefetch_depth=int(count or 1))
        if kind == "dha" and not count and not sel:
            return cls([UnitPlan("dha", "dha", recompute, offload=off)] * n_blocks)
        if kind in ("resident", "device") and count and int(count) <= n_blocks:
            n = int(count)
            if kind == "resident":
                return cls([UnitPlan("resident", "resident", recompute, offload=off, selective=sel)] * n
                           + [prefetch] * (n_blocks - n))
            return cls([UnitPlan("resident", "resident", recompute, optimizer="device", offload=off, selective=sel)] * n
                       + [prefetch] * (n_blocks - n),
                       rest_optimizer="device")
        raise ValueError(
            f"unknown plan {spec!r} for {n_blocks} blocks; write prefetch[N], dha, residentN or deviceN "
            f"(N from 0 to {n_blocks}), optionally with +recompute, +selective (not with dha) or +offload, then +devacc"
        )

    def describe(self) -> str:
        """One line per block (``accumulate=device`` where it sums micro-batches on the device), then notes."""
        lines = [f"{i:3d}: forward={u.forward:8s} backward={u.backward:8s} "
                 f"activations={u.activations:9s} "
                 f"optimizer={u.optimizer}" + (" accumulate=device" if u.accumulate == "device" else "")
                 for i, u in enumerate(self.units)]
        if self.predicted_step_s is not None:
            lines.append(f"predicted step: {self.predicted_step_s * 1e3:.1f} ms")
        return "\n".join(lines + self.notes)
