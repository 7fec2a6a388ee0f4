"""Planning a MemFerry run: profile one step, then let the scheduler choose the plan.

    plan = plan_for(model, (inputs, targets), device_budget="16GB", optim=cfg)   # profiler -> cost model/scheduler
    engine = MemFerry(model, optim=cfg, device_budget="16GB", plan=plan)         # executor

:func:`plan_for` measures one step (:func:`~strategies.memferry.profiler.profile_step`), reads
the link rates (:func:`~strategies.memferry.cost.links_from_probe`) and asks the scheduler
(:func:`~strategies.memferry.scheduler.schedule`) for the fastest plan whose predicted peak
fits the budget. ``MemFerry(..., plan="auto", sample=...)`` calls it first. Under data
parallelism the group's first rank profiles and schedules and the others take its plan, so
every rank homes the same units alike.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import xpu
from xpu import Backend
from xpu.dist import collective_timeout, decide_on_first_rank

from .compute_dtype import cast_parameters, check_compute_dtype, restore_parameters
from .config import AdamW, Plan
from .hf_models import kv_cache_off
from .split_update import updates_split
from .units import split_units

__all__ = ["plan_for", "replan", "SETUP_NOTE"]

#: How the plan's note on setup time begins (the rehearsal carries it to a plan made again).
SETUP_NOTE = "setup:"

_log = logging.getLogger("xpu.memferry")


def plan_for(model: nn.Module, sample: tuple[Any, Any] | None, device_budget: int | str | None = None, *,
             optim: AdamW | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             blocks: nn.ModuleList | None = None, device: int | None = None, backend: Backend | None = None,
             process_group: Any = None, memory_margin: float = 0.10,
             compute_dtype: torch.dtype | None = None, accumulation_steps: int = 1,
             compile_blocks: bool = False) -> Plan:
    """The plan MemFerry's scheduler picks for ``model`` under ``device_budget``, from one profiled step.

    The arguments mean what they mean to :class:`~strategies.memferry.engine.MemFerry`; the
    model is left as it came (with ``compute_dtype``, it is profiled cast and cast back).

    Args:
        model: the model on the host.
        sample: ``(inputs, targets)`` of one batch, the step profiled (None on data-parallel
            ranks other than the group's first, which take its plan); ``inputs`` may be a dict
            of keyword arguments, as for :class:`~.engine.MemFerry`.
        device_budget: most device memory the run may use (None: what the device has free).
        optim: the optimizer settings training will use (its host kernel is measured).
        loss_fn, blocks, device, backend, process_group, memory_margin, compute_dtype,
            accumulation_steps, compile_blocks: as :class:`~strategies.memferry.engine.MemFerry`'s (the
            micro-batches per step keep device-homed units' fp32 gradients resident all step:
            ``cost.grads_persist``).

    Raises:
        ValueError: no ``sample`` where one is profiled, a bad ``memory_margin`` or
            ``compute_dtype``, or a budget no plan fits.
    """
    if not 0.0 <= memory_margin < 1.0:
        raise ValueError(f"memory_margin must lie in [0, 1), got {memory_margin}")
    from .accumulation import check_accumulation_steps

    check_accumulation_steps(accumulation_steps)
    backend = backend or xpu.get_backend()
    index = backend.index_of(device)

    if process_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        process_group = dist.group.WORLD
    alone = process_group is None or dist.get_world_size(process_group) == 1

    def plan_here() -> Plan:
        with kv_cache_off(model):  # a Hugging Face model's cache would carry one timed pass's graph into the next
            return _profile_and_schedule(model, sample, device_budget, optim or AdamW(), loss_fn, blocks, index,
                                         backend, memory_margin, compute_dtype, accumulation_steps,
                                         data_parallel=not alone, compile_blocks=compile_blocks)

    if alone:
        return plan_here()
    # Scheduled once, on the first rank; a failure there raises on every rank instead of hanging them.
    return decide_on_first_rank(plan_here, process_group, what="schedule MemFerry's plan", timeout=collective_timeout())


def _profile_and_schedule(model: nn.Module, sample: Any, device_budget: Any, optim: AdamW, loss_fn: Any, blocks: Any,
                          index: int, backend: Backend, margin: float, compute_dtype: torch.dtype | None,
                          accumulation_steps: int = 1, data_parallel: bool = False,
                          compile_blocks: bool = False) -> Plan:
    """Profile one step here and pick the fastest plan the budget allows."""
    from xpu.units import parse_bytes

    from .compiled_blocks import compiled_note
    from .cost import links_from_probe
    from .profiler import profile_step
    from .scheduler import schedule

    check_compute_dtype(model, compute_dtype)
    originals = cast_parameters(model, compute_dtype)  # profiled as it will compute
    try:
        units = split_units(model, blocks)
        n_blocks = sum(u.is_block for u in units)
        if sample is None:
            raise ValueError("plan='auto' profiles one step first: pass sample=(inputs, targets) of one batch")
        inputs, targets = sample
        started = time.perf_counter()
        profile = profile_step(model, units, backend, index, inputs, targets, loss_fn=loss_fn, blocks=blocks,
                               host_kernel=optim.host_kernel, compile_blocks=compile_blocks)
        profiled = time.perf_counter()
        profile.accumulation_steps = accumulation_steps  # what persists across micro-batches (cost.grads_persist)
        profile.clipping = optim.max_grad_norm is not None  # device gradients held until step() (likewise)
        profile.data_parallel = data_parallel  # ... as fp32 sums, averaged over the ranks
        # speculative clipping's backups are host-memory bytes too (host_budget.update_bytes)
        profile.clip_mode = optim.clip_mode
        profile.clip_fire_rate = optim.clip_fire_rate  # the steps after clipped ones weigh too (clip_plan.py)
        profile.flat_sends = optim.flat_sends  # a host-homed unit's gradients gathered once more (flat_sends.py)
        profile.split_update = updates_split(optim, data_parallel)  # what the worker will do (split_update.py)
        profile.host_order = "landing" if data_parallel else optim.host_order  # what the worker will do
        budget = parse_bytes(device_budget) if device_budget is not None else backend.mem_info(index)[0]
        plan = schedule(profile, links_from_probe(backend, index), budget, n_blocks, allow_dha=backend.caps.dha,
                        margin=margin)
        # Setup is most of a short run's time: say where it went.
        plan.notes.append(f"{SETUP_NOTE} profiled one step in {profiled - started:.1f} s, searched plans in "
                          f"{time.perf_counter() - profiled:.1f} s")
        if note := compiled_note(profile):
            plan.notes.append(note)
    finally:
        restore_parameters(model, originals)
    _log.info("MemFerry plan for %s:\n%s", type(model).__name__, plan.describe())
    return plan


def replan(plan: Plan, budget_bytes: int, backend: Backend, device: int, margin: float, *,
           profile: Any = None, host_sums: bool = True, device_sums: bool = True) -> Plan:
    """``plan`` made again by the scheduler, from the profile it was made from (or ``profile``,
    e.g. one calibrated on the rehearsal step), under ``budget_bytes`` with ``margin`` (no new
    profiling); ``host_sums``, ``device_sums``: as :func:`~.scheduler.schedule` takes them.

    Raises:
        ValueError: ``plan`` was not made by the scheduler (it keeps no profile).
        NoPlanFitsError: no plan fits.
    """
    from .cost import links_from_probe
    from .scheduler import schedule

    if plan.profile is None:
        raise ValueError("only a plan the scheduler made (plan='auto' or plan_for) can be made again under another budget")
    again = schedule(profile or plan.profile, links_from_probe(backend, device), budget_bytes, len(plan.units),
                     allow_dha=backend.caps.dha, margin=margin, host_sums=host_sums,
                     device_sums=device_sums)
    _log.info("MemFerry plan made again under %d bytes, margin %.0f%%:\n%s", budget_bytes, margin * 100, again.describe())
    return again
