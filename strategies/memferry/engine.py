"""``MemFerry``: the user-facing engine.

    engine = MemFerry(model, optim=AdamW(lr=3e-4, weight_decay=0.1), device_budget="16GB")
    for batch in data:
        loss = engine.train_step(batch, targets)

or, step by step: ``loss = loss_fn(engine(batch), targets); engine.backward(loss); engine.step()``.
A plain ``loss.backward()`` does what ``engine.backward(loss)`` does (``backward_gate.py``), so
loops that call it themselves (Hugging Face's Trainer: ``hf_trainer.py``) drive the engine too.

The engine runs a given :class:`~strategies.memferry.config.Plan` (the executor). A plan chosen
for the model comes from :func:`~strategies.memferry.planning.plan_for` (profiler, then cost
model and scheduler); ``plan="auto"`` calls it first::

    plan = plan_for(model, (inputs, targets), device_budget="16GB", optim=cfg)
    engine = MemFerry(model, optim=cfg, device_budget="16GB", plan=plan)
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

import xpu
from xpu import Backend, in_host_memory

from ..weight_decay import no_decay_names

from .accumulation import AccumulationError, MicroBatches, check_accumulation_steps, paired_units
from .backward_gate import gate_outputs, queue_at_backward_end
from .batch_growth import fit_batch, settle_watch, watch_unplanned_padding
from .clip_norms import GlobalNormClip
from .clip_plan import HINT_STEP, fire_rate_hint
from .compute_dtype import cast_parameters, check_compute_dtype, restore_parameters
from .config import AdamW, Plan, UnitPlan
from .data_parallel import DataParallel
from .device_optimizer import DeviceOptimizer
from .engine_readings import EngineReadings
from . import gc_pauses
from .executor import Executor
from .plan_check import check_budget, check_plan
from .hf_models import model_loss, no_kv_cache
from .host_optimizer import HostOptimizer
from .planning import SETUP_NOTE, plan_for
from .sequence_scaling import batch_shape
from .shadow import ShadowModel
from .split_update import updates_split
from .sum_placement import PLACEMENTS
from .units import split_units

__all__ = ["MemFerry"]

_log = logging.getLogger("xpu.memferry")

#: After this many steps the engine compares its host AdamW rate with the plan's (the first
#: steps' updates are done by then: ``EngineReadings._check_host_rate``).
_RATE_CHECK_STEP = 4


class MemFerry(EngineReadings):
    """Train ``model`` with its parameters homed in host memory.

    Args:
        model: an ordinary module on the host, with a ``ModuleList`` of repeated blocks (or
            pass ``blocks=``). The engine takes it over: its parameters become views of the
            engine's buffers (read them with :meth:`state_dict`). All trainable parameters
            must share one dtype: the compute dtype (bf16 for speed, fp32 for exactness), or
            fp32 when ``compute_dtype`` is given.
        optim: optimizer settings (AdamW).
        device_budget: most device memory this engine may use, e.g. ``"16GB"`` (None: the
            whole device). Enforced as a per-process cap, as a smaller device would.
        plan: per-block execution plan: a :class:`Plan` (e.g. from
            :func:`~strategies.memferry.planning.plan_for`), a :meth:`Plan.from_spec` name,
            ``"auto"`` (:func:`~strategies.memferry.planning.plan_for` first: profile one step on
            ``sample``, then let the scheduler choose under ``device_budget``; the plan is logged
            and kept in :attr:`plan`; under data parallelism the first rank profiles and
            schedules and every rank takes its plan, so all ranks home the same units alike), or
            None (every block ``prefetch``, depth 1).
        loss_fn: ``loss_fn(outputs, targets)`` for :meth:`train_step`; None means the model
            returns the loss itself when called as ``model(inputs, targets)``.
        blocks: the repeated blocks, if auto-detection should not choose.
        device: device index (default: the current device).
        backend: an xpu backend (default: ``xpu.get_backend()``).
        process_group: data parallelism over this torch.distributed group (one engine per
            rank, each on its own device and micro-batch; see ``data_parallel.py``). None: the
            whole world when torch.distributed is initialised with several ranks, else none.
        sample: ``(inputs, targets)`` of one batch, for ``plan="auto"``; for a model taking
            ``labels``, ``inputs`` may be a dict of its keyword arguments (a padded batch's
            ``input_ids`` and ``attention_mask``: a masked forward allocates more).
        multipath: route weight loads through the scaleup multi-path copier (the direct host link
            plus relays through peer devices, split adaptively: ScaleUp-MemFerry), for a process
            whose peers' host links are idle. None or False: off. Under data parallelism the
            ranks already use each other's links: each loads its shard and they all-gather the
            rest on the devices, and relays would compete with the peers' own loads; there the
            copier's transfers are also host-synchronous (a shard must be on the device before
            its all-gather is queued).
        memory_margin: with ``plan="auto"``, the share of predicted peak memory added for
            allocator fragmentation before comparing with ``device_budget`` (0.10: safe; on the
            H200 the caching allocator reserved 6.5 % above the allocated peak).
        compute_dtype: the dtype the device computes in (e.g. ``torch.bfloat16``) for a model
            whose parameters are fp32: their fp32 values become the masters exactly and the
            parameters are cast to it (buffers are left as they are), as FSDP's
            ``MixedPrecisionPolicy(param_dtype=...)`` or DeepSpeed's bf16 mode keep an fp32
            model. A model built in bf16 has lost those bits before the engine sees it.
            :meth:`state_dict` gives fp32 tensors back. None: the parameters' own dtype.
        accumulation_steps: micro-batches per optimizer step. Each runs ``loss = engine(x, y)``
            and ``engine.backward(loss / N)``; then one ``engine.step()`` applies ONE AdamW
            update from the sum of their gradients (fp32 sums: a 4-byte-per-parameter buffer
            per host-homed unit shard when N > 1), clipped on that sum's norm. A host-updated
            block sums on the host (each micro-batch's gradient goes home and is added there)
            or, planned ``UnitPlan(accumulate="device")`` (``plan="auto"`` chooses it where the
            budget allows), in a 4-byte-per-parameter fp32 device buffer held through the step,
            sending only the sum home: bit-equal, with N - 1 fewer gradient copies and no host
            additions. Updates start overlapped with the backward of the N-th micro-batch; a
            ``step()`` after fewer backwards applies what was accumulated then. Calls out of order raise
            :class:`~strategies.memferry.accumulation.AccumulationError`.
        no_decay: qualified names of parameters trained without weight decay (None: biases and
            normalisation layers' parameters, as Hugging Face's Trainer groups them:
            :func:`strategies.weight_decay.no_decay_names`; an empty set: decay everything).
        rehearse: with a ``device_budget`` and a ``sample`` (one process), run one step on the
            sample at learning rate 0 before training (``rehearsal.py``): weights stay exactly as
            they were; a scheduled plan whose real peak overshoots the budget (the allocator's
            reserve, or what the memory model misses) is made again with a larger margin, and a
            given one is refused (``PlanOverBudgetError``), instead of failing in training.
        sum_placement: under accumulation with ``plan="auto"``: ``"race"`` (default) also
            rehearses the best plan summing micro-batches on the other side (host or device)
            where it is predicted close, and keeps the faster on the wall clock
            (``sum_placement.py``); ``"plan"`` keeps the scheduler's pick unraced.
        freeze_setup: freeze what the set-up made alive (``gc.freeze``, after one collection),
            so Python's full garbage collections walk only what steps make: unfrozen, one
            walked 380 thousand objects for 133-141 ms, GIL held, every 5-7 steps of a
            128-block model (``gc_pauses.py``). :meth:`close` thaws them (the last engine to
            close). None: on real devices, not the cpu backend's virtual ones (whose steps are
            not timed, and whose tests build engines by the thousand, a collection each).
        compile_blocks: run blocks through ``torch.compile``, profiled so too
            (``compiled_blocks.py``; blocks read over the link or offloading stay eager).
            Off by default: it pays where blocks issue many small kernels (LoRA: 1.53x the
            tokens/s in steps, session 57), little on large GEMMs, and costs a compile.

    Frozen parameters (``requires_grad=False``, e.g. a LoRA model's base weights) are homed and
    moved with their units like the others but have no optimizer state (no master, moments or
    gradient): 2 bytes of pinned host memory per parameter in bf16, 4 in fp32.
    """

    def __init__(
        self,
        model: nn.Module,
        optim: AdamW | None = None,
        device_budget: int | str | None = None,
        plan: Plan | str | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        blocks: nn.ModuleList | None = None,
        device: int | None = None,
        backend: Backend | None = None,
        process_group: Any = None,
        sample: tuple[Any, Any] | None = None,
        memory_margin: float = 0.10,
        multipath: bool | None = None,
        compute_dtype: torch.dtype | None = None,
        accumulation_steps: int = 1,
        no_decay: Iterable[str] | None = None,
        rehearse: bool = True,
        sum_placement: str = "race",
        freeze_setup: bool | None = None,
        compile_blocks: bool = False,
    ) -> None:
        check_accumulation_steps(accumulation_steps)
        if any(p.numel() and not p.untyped_storage().nbytes() for p in model.parameters()):
            raise ValueError("the model's parameters point at memory a closed MemFerry engine gave back: build the "
                             "model again, and load the engine.state_dict() taken before close() if it is to go on")
        if sum_placement not in PLACEMENTS:
            raise ValueError(f"sum_placement must be one of {PLACEMENTS}, got {sum_placement!r}")
        no_decay = no_decay_names(model) if no_decay is None else set(no_decay)
        no_kv_cache(model)
        if not 0.0 <= memory_margin < 1.0:
            raise ValueError(f"memory_margin must lie in [0, 1), got {memory_margin}")
        check_compute_dtype(model, compute_dtype)
        self.backend = backend or xpu.get_backend()
        self.device = self.backend.index_of(device)
        self.cfg = optim or AdamW()
        self._lr = self.cfg.lr  # the rate set last (set_lr): a re-plan after running out of memory keeps it
        # Before profiling and the shadow allocate: prefetch slots of many sizes come and go,
        # and a fragmented cache can fail a plan whose allocated peak fits the budget.
        self.backend.avoid_fragmentation()
        # Cast before anything reads the model (the scheduler profiles it in its compute dtype);
        # the fp32 originals stay alive only until the shadow model has taken them as masters.
        originals = cast_parameters(model, compute_dtype)
        #: the device's cap before this engine set ``device_budget`` as its cap; :meth:`close` puts it back
        self._previous_cap = previous_cap = self.backend.memory_cap(self.device)
        self.model = model
        self.loss_fn = loss_fn
        self.dp = None
        #: what building the engine's parts for another plan needs again (``_assemble``, ``rehearsal.py``)
        self._setup = {"blocks": blocks, "no_decay": no_decay, "device_budget": device_budget,
                       "compute_dtype": compute_dtype, "accumulation_steps": accumulation_steps,
                       "multipath": multipath, "memory_margin": memory_margin, "sum_placement": sum_placement,
                       "freeze_setup": not self.backend.caps.virtual_devices if freeze_setup is None else freeze_setup,
                       "compile_blocks": bool(compile_blocks)}
        try:
            if process_group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                self.dp = DataParallel.create(self.backend.device(self.device), process_group)
            units = split_units(model, blocks, no_decay)
            n_blocks = sum(u.is_block for u in units)
            if plan == "auto":  # the convenience form: plan first (the model is already cast)
                plan = plan_for(model, sample, device_budget, optim=self.cfg, loss_fn=loss_fn, blocks=blocks,
                                device=self.device, backend=self.backend, process_group=process_group,
                                memory_margin=memory_margin, accumulation_steps=accumulation_steps,
                                compile_blocks=compile_blocks)
            elif isinstance(plan, str):
                plan = Plan.from_spec(plan, n_blocks)
            plan = plan or Plan.uniform(n_blocks, UnitPlan("prefetch", "prefetch"))
            self._assemble(units, plan, originals)
        except BaseException:
            # Refused (a bad budget, no fitting plan, too little host memory): give the caller
            # back the model as it came; units already made into shadows are the engine's.
            restore_parameters(model, originals)
            self.backend.set_memory_cap(self.device, previous_cap)
            raise
        del originals
        if rehearse and sample is not None and self.dp is None:
            from .rehearsal import fit_by_rehearsal, give_back

            try:
                fit_by_rehearsal(self, sample)
            except BaseException:
                give_back(self)  # the model as it came (its weights are unchanged), buffers released
                self.backend.set_memory_cap(self.device, previous_cap)
                raise

    def _assemble(self, units: list, plan: Plan, originals: dict[str, torch.Tensor],
                  kept: dict[str, Any] | None = None) -> None:
        """Build the engine's parts for ``plan``: the shadow model (taking ``originals`` as
        masters, and ``kept``'s optimizer state: ``ShadowModel``), the host and device
        optimizers, the executor; counters start at zero."""
        setup = self._setup
        n_blocks = sum(u.is_block for u in units)
        check_plan(plan, n_blocks, self.backend, setup["accumulation_steps"])  # before anything touches the model
        device_homes = {u.index for u, up in zip(units, plan.units) if up.optimizer == "device"}
        if plan.rest_optimizer == "device":
            device_homes.add(units[-1].index)
        if setup["device_budget"] is not None:
            check_budget(units, plan, device_homes, setup["device_budget"])
            self.backend.set_memory_cap(self.device, setup["device_budget"])
        made = time.perf_counter()  # pinning a model's host copies can take a minute (128-layer GPT, H100)
        with self.backend.device_scope(self.device):
            self.shadow = ShadowModel(units, self.backend, self.device, device_homes, self.dp, originals=originals,
                                      accumulate=setup["accumulation_steps"] > 1,
                                      paired=paired_units(units, plan, setup["accumulation_steps"], self.dp is not None),
                                      backup_budget=self.cfg.backup_budget() if self.cfg.speculative else 0,
                                      kept=kept, split=updates_split(self.cfg, self.dp is not None))
        plan.notes.append(f"{SETUP_NOTE} made the shadow model in {time.perf_counter() - made:.1f} s")
        read_in_place = frozenset(u.index for u, up in zip(units, plan.units) if "dha" in (up.forward, up.backward))
        #: global-norm clipping (None without ``max_grad_norm``): where norms are taken (clip_norms.py)
        self.clip = (GlobalNormClip.for_plan(self.backend, self.cfg.max_grad_norm, units, plan,
                                             {s.unit.index for s in self.shadow.shadows if s.home == "host"},
                                             setup["accumulation_steps"], self.dp is not None)
                     if self.cfg.max_grad_norm is not None else None)
        self.optimizer = HostOptimizer(self.cfg, self.shadow.shadows, self.dp,
                                       bind=functools.partial(self.backend.bind_process, self.device),
                                       whole_on_host=read_in_place, backup=self.shadow.backup, clip=self.clip,
                                       steps=setup["accumulation_steps"])
        self.device_optimizer = DeviceOptimizer(self.cfg, self.shadow.shadows, self.backend,
                                                norms=self.clip.norms if self.clip is not None else None)
        self.copier = self._copier(setup["multipath"])
        self.executor = Executor(self.backend, self.device, self.shadow, plan, self.optimizer, self.device_optimizer,
                                 copier=self.copier, accumulation_steps=setup["accumulation_steps"], clip=self.clip,
                                 compile_blocks=setup["compile_blocks"])
        self.plan = plan
        self._steps = 0
        self.micro = MicroBatches(setup["accumulation_steps"])
        self._handle: Any = None  # the Optimizer-shaped handle, once asked for
        self._in_backward = False  # between the gate's backward and the end-of-backward callback
        if setup["freeze_setup"]:  # before a rehearsal: its clocked steps run as training's will
            gc_pauses.hold(self)

    def _copier(self, multipath: bool | None) -> Any:
        """The multi-path copier for weight loads, or None (see ``multipath``)."""
        if not multipath:
            return None
        from scaleup import MultiPathCopier

        return MultiPathCopier(self.backend, self.device, chunk_bytes=8 << 20, probe="auto")

    # ------------------------------------------------------------------ training
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Forward pass on the device; host tensors in ``inputs`` are copied there first.

        A grad-enabled forward's output tensors get gradient hooks that start the engine's
        backward bookkeeping (``backward_gate.py``), so a plain
        ``loss.backward()`` on a loss made from them works as :meth:`backward` does.
        """
        grad = torch.is_grad_enabled()
        self.micro.check_forward(grad)
        if grad:  # a longer micro-batch than planned for: plan for it first (batch_growth.py)
            fit_batch(self, *batch_shape(inputs, kwargs))
            watch_unplanned_padding(self, kwargs)
        with self.backend.device_scope(self.device):
            inputs = tuple(self._to_device(x) for x in inputs)
            kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
            self.micro.forward_started(grad)
            self.executor.begin_forward()
            out = self.model(*inputs, **kwargs)
            return gate_outputs(out, self._backward_begins) if grad else out

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass; gradients go to host memory. On the step's last micro-batch (the
        ``accumulation_steps``-th backward) updates start as they land; before it gradients
        are only summed. The same as ``loss.backward()``, with misuse refused before autograd starts."""
        if self._handle is not None:
            self._handle.current_lr()  # refuse differing group rates before anything changes
        self.micro.check_backward()
        before = self.micro.backwards
        with self.backend.device_scope(self.device):
            try:
                loss.backward()
            finally:
                if self._in_backward:  # autograd failed after the gate: end as a finished backward would
                    self._backward_ends()
        if self.micro.backwards == before:
            raise AccumulationError("this loss does not come from the engine's grad-enabled forward (no gradient "
                                    "reached the engine): compute it from loss = engine(inputs, ...) outputs")

    def _backward_begins(self) -> None:
        """Autograd reached the engine's outputs (see :meth:`__call__`): count the micro-batch, hand
        the learning rate over, switch the executor to backward and queue :meth:`_backward_ends`.
        Once per backward: the hooks of the forward's other outputs find it begun."""
        if self._in_backward:
            return
        if self._handle is not None:
            self._handle.current_lr()
        final = self.micro.begin_backward()
        if final and self._handle is not None:
            self._handle.apply_lr()  # updates start during this backward: they take the groups' lr
        with self.backend.device_scope(self.device):
            self.executor.begin_backward(final)
        self._in_backward = True
        queue_at_backward_end(self._backward_ends)

    def _backward_ends(self) -> None:
        """The whole backward is done: offload gradients that did not arrive (unused parameters)."""
        if not self._in_backward:
            return
        self._in_backward = False
        with self.backend.device_scope(self.device):
            self.executor.end_backward()

    def step(self) -> None:
        """End the step: with clipping, the coefficient is computed now (after every gradient is in;
        on the device, without waiting, where every norm is there: ``clip_norms.py``) and the host
        applies it: held updates run, speculative ones are kept (no clip) or rolled back and
        re-applied (``AdamW.clip_mode``; counts in :meth:`clip_stats`).

        Without clipping, updates started as gradients landed and this returns at once. After
        fewer backwards than ``accumulation_steps``, the accumulated updates are applied now.
        """
        early = self.micro.begin_step()  # refuses a step with nothing accumulated, before anything changes
        if self._handle is not None:
            self._handle.apply_lr()  # before held updates are queued (flush, clipping)
        if early:
            self.executor.flush_updates()
            with self.backend.device_scope(self.device):
                self.device_optimizer.flush()
            self.optimizer.flush()
        self.micro.stepped()
        device_coef = host_coef = 1.0
        if self.clip is not None:
            with self.backend.device_scope(self.device):
                device_coef, host_coef = self.clip.coefficient(self._host_sqnorm, self.executor.d2h)
        with self.backend.device_scope(self.device):
            self.device_optimizer.finish_step(device_coef)
        self.optimizer.finish_step(host_coef)
        self._steps += 1
        settle_watch(self)  # the first step at a longer batch shape: measured, re-planned if it went over
        if self._steps == _RATE_CHECK_STEP:
            self._check_host_rate()
        if self._steps == HINT_STEP and self.clip is not None and self.plan.profile is not None and (
                hint := fire_rate_hint(self.clipped_steps, self._steps, self.cfg.clip_fire_rate)):
            _log.warning(hint)  # the plan was searched (profile) for another firing rate

    def _host_sqnorm(self) -> float:
        """The host's part of the squared global norm (its gradients' squares; every rank's)."""
        sq = self.optimizer.grad_sqnorm()  # this rank's shards only, under data parallelism
        return self.dp.all_sum(sq) if self.dp is not None else sq

    def train_step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Forward, backward and step; returns the loss (detached, still on the device)."""
        loss = self._loss(inputs, targets)
        self.backward(loss)
        self.step()
        return loss.detach()

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next updates."""
        self._lr = lr
        self.optimizer.set_lr(lr)
        self.device_optimizer.set_lr(lr)

    def synchronize(self) -> None:
        """Wait for every pending update and transfer."""
        self.optimizer.wait_all()
        self.backend.synchronize(self.device)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """``{"model": full host tensors, "optimizer": fp32 masters and moments}``; waits for updates.

        ``copy=False`` hands host-homed buffers out as views where their dtype is the state's (no
        second copy of a state that may be most of the host's memory), valid until the next step:
        for a checkpoint written at once. Under data parallelism every rank must call it (shards
        are gathered) and gets the whole.
        """
        self.synchronize()
        return {"model": self.shadow.state_dict(copy), "optimizer": self.shadow.optimizer_state_dict(copy)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (checked before anything changes)."""
        self.synchronize()
        self.shadow.load(state["model"], state.get("optimizer"))
        self.optimizer.sync_steps_from_shadows()
        self.device_optimizer.sync_steps_from_shadows(self.shadow.shadows)
        self.executor.invalidate_device_copies()

    def as_torch_optimizer(self) -> Any:
        """A ``torch.optim.Optimizer`` standing for this engine (one per engine), so schedulers
        such as ``LambdaLR`` drive its learning rate; see ``optim_handle.py``."""
        if self._handle is None:
            from .optim_handle import MemFerryOptimizer

            self._handle = MemFerryOptimizer(self)
        return self._handle

    def close(self) -> None:
        """Stop the optimizer thread, remove hooks, give the host buffers and the device memory
        back (now, not at a later garbage collection) and lift the device cap ``device_budget``
        set (the cap before the engine is back).

        The model's parameters are left pointing at freed memory; take :meth:`state_dict`
        first to keep the weights (a new engine refuses the model until it is built again).
        """
        gc_pauses.release(self)
        self.optimizer.close()
        self.executor.close()
        if self.copier is not None:
            self.copier.close()
        self.shadow.release()
        self.backend.set_memory_cap(self.device, self._previous_cap)

    def _to_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and in_host_memory(x):
            return self.backend.to_device(x, self.device)
        return x

    def fit_shape(self, rows: int, seq: int) -> None:
        """Before a step: make the plan hold micro-batches of up to ``rows`` x ``seq`` tokens,
        planning again where its predicted peak there is over the budget (``batch_growth.py``); a
        loop that knows its step's micro-batches calls it with the most rows and the longest."""
        if self.micro.backwards:
            raise AccumulationError("fit_shape is for a step's start: call it before the step's first micro-batch")
        fit_batch(self, int(rows), int(seq))

    def eval_loss(self, inputs: Any, targets: Any = None) -> float:
        """The loss of one batch under ``torch.no_grad`` (evaluation: no gradients, no update)."""
        with torch.no_grad(), self.backend.device_scope(self.device):
            return float(self._loss(inputs, targets))

    def _loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The forward's loss: ``loss_fn`` on the outputs, or the model's own (``targets`` None: the output)."""
        if self.loss_fn is not None:
            return self.loss_fn(self(inputs), self._to_device(targets))
        if targets is None:
            return self(inputs)
        # the model computes its own loss: model(idx, targets), or model(x, labels=y).loss (Hugging Face)
        return model_loss(self, inputs, targets, labels_model=self.model)
