"""MemFerry as a benchmarked system (``xpu bench`` name ``memferry``).

Options:
    plan: a :meth:`~strategies.memferry.config.Plan.from_spec` name, e.g.
        ``prefetch+recompute`` or ``device15+recompute``, or ``auto``: the scheduler profiles
        one batch and picks the plan under the scenario's device cap (its prediction goes in
        the row's notes, the explained plan in the worker log).
    max_grad_norm: global-norm clipping (None: off).
    clip_mode: with clipping, ``speculative`` (host updates overlap backward, exact rollback of
        clipped steps; the notes count them) or ``wait`` (see ``AdamW.clip_mode``).
    host_threads: CPU threads of the host optimizer (None: torch's default).
    host_kernel: ``auto``, ``torch`` or ``single-pass`` (see ``host_kernel.py``).
    host_order: ``deadline`` (default) or ``landing`` (``AdamW.host_order``; the plan is priced for the order given).
    clip_fire_rate: with ``max_grad_norm``, the share of steps expected to clip (``AdamW.clip_fire_rate``):
        the scheduler weighs the steps after clipped ones too. 0 (default): it does not.
    landing_wait: ``spin`` (default) or ``sleep`` (``AdamW.landing_wait``): how the host optimizer's
        worker waits for gradients to land. For an A/B of what a spinning wait costs the sends.
    flat_sends: ``false`` (default) or ``true`` (``AdamW.flat_sends``): a unit's gradients gathered
        on the device and sent home in one copy. For an A/B of what the per-tensor copies cost.
    split_update: unset (default: on where ``max_grad_norm`` is), ``false`` or ``true``
        (``AdamW.split_update``): under accumulation, the working copy first and the fp32 state
        while the next step's earlier micro-batches run.
    host_piece: parameters per call of the single-pass loop (``AdamW.host_piece``; unset: 2**24).
        For an A/B of what a call's return costs against how long a sooner unit may wait.
    gil_switch_s: the interpreter's thread switch interval for the row (``sys.setswitchinterval``,
        seconds; unset: CPython's 5 ms), put back when the row closes. A thread waiting for the
        GIL waits up to that long for a holder running Python; for an A/B of what the host
        optimizer's loop calls lose that way (its ``call`` phase).
    memory_margin: the scheduler's fragmentation margin on predicted peak memory (plan auto).
    compile_blocks: ``false`` (default) or ``true`` (``MemFerry(compile_blocks=...)``): blocks run
        through ``torch.compile``, profiled so too. For an A/B of what compiling them pays in steps.
    freeze_setup: unset (default: on real devices), ``true`` or ``false``
        (``MemFerry(freeze_setup=...)``): what the set-up made alive frozen out of Python's full
        garbage collections. For an A/B of what their pauses cost a step (the row's ``gc_full_ms_steps``).
    allocator_cap: ``plan`` (the engine's own: the caching allocator held to the rehearsed
        plan's predicted peak) or ``budget`` (re-capped at the scenario's device cap after setup:
        fewer cache flushes, a reserved peak that may pass the prediction). For an A/B of what
        the allocator's retries (``alloc_retries``) cost a step.
    sum_placement: ``race`` (default) or ``plan`` (``MemFerry(sum_placement=...)``): under
        accumulation, rehearse the scheduler's pick against its best plan summing micro-batches
        on the other side (host or device) and keep the faster, or keep the pick. For an A/B of
        what the race gains.
    loss_chunks: compute the model's loss over this many token slices (``CausalLM.loss_chunks``):
        frees the fp32 logits' memory for the scheduler to spend on device-homed blocks. 1: the
        model as the baselines run it.
    loss_grad_in_forward: ``true`` (default): each slice's gradients made in forward, the head
        run once per slice; ``false``: each slice recomputed in backward
        (``CausalLM.loss_grad_in_forward``, :mod:`strategies.models.sliced_loss`). For an A/B.
    lora: ``{r, alpha, dropout, target_modules}`` (model family ``hf``): peft LoRA adapters on
        the scenario's model, base weights frozen (homed and moved, no optimizer state), through
        the ``hf`` family's own ``lora`` key (:mod:`strategies.models.hf`). None: full fine-tuning.
    export_hf: after the last step (untimed), write the trained model as a Hugging Face folder
        (:func:`strategies.training.export.export_hf`, LoRA merged) under a temporary directory,
        reload it with ``from_pretrained`` and compare its loss on a slice of the first
        micro-batch with the engine's own (the notes say "export reloads" and both losses).

The scenario's ``accumulation_steps`` N goes to ``MemFerry(accumulation_steps=N)``: a step is N
``engine(x, y)`` / ``engine.backward(loss / N)`` and one ``engine.step()``.

The row's notes end with the host optimizer's time per step by phase (milliseconds,
averaged over every step run), which says whether the CPU or the device bounds a step, and its
rate per parameter beside the rate the scheduler planned with (plan ``auto``) and the floor
host memory sets; the row has those figures as fields too (:mod:`.host_rate`:
``host_ns_per_param``, ``host_planned_ns_per_param``, ``host_over_floor``, ...), with the
scheduler's ``predicted_step_s`` beside the measured ``step_s``. A step that runs out of device
memory is planned again with a larger margin and run again, as ``xpu train`` does
(``oom_recovery.ReplanningSteps``): the row's ``replans`` counts such steps and its notes quote
the re-plan; the step's time includes the failed attempt.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import torch

from .base import BenchSystem, SystemContext, engine_step, phase
from .host_rate import host_metrics, host_note
from ..thread_waits import run_delays, waited_s

from strategies.memferry import AdamW, MemFerry, Plan
from strategies.memferry.cost import links_from_probe, predict_clip_fired
from strategies.memferry.compiled_blocks import compiled_runs, compiles
from strategies.memferry.host_clock import HostReading
from strategies.memferry.oom_recovery import ReplanningSteps

__all__ = ["MemFerrySystem", "make"]


class MemFerrySystem(BenchSystem):
    """The model built on the host, handed to a :class:`MemFerry` engine."""

    optimizer_on_host = True

    def __init__(self, ctx: SystemContext) -> None:
        measure = ctx.options["measure"]
        if measure not in ("step", "host-optimizer"):
            raise ValueError(f"memferry: measure must be 'step' or 'host-optimizer', got {measure!r}")
        hold = ctx.options.get("allocator_cap", "plan")
        if hold not in ("plan", "budget"):
            raise ValueError(f"memferry: allocator_cap must be 'plan' or 'budget', got {hold!r}")
        switch = ctx.options.get("gil_switch_s")
        if switch is not None and not (isinstance(switch, (int, float)) and 0 < switch <= 1):
            raise ValueError(f"memferry: gil_switch_s must be seconds in (0, 1] (e.g. 0.0005) or unset, got {switch!r}")
        compile_blocks = ctx.options.get("compile_blocks", False)
        if not isinstance(compile_blocks, bool):
            raise ValueError(f"memferry: compile_blocks must be true or false, got {compile_blocks!r}")
        lora, self._export = ctx.options.get("lora"), bool(ctx.options.get("export_hf", False))
        if (lora is not None or self._export) and ctx.family != "hf":
            raise ValueError(f"memferry: options lora and export_hf need a model of family hf, not {ctx.family!r}")
        if lora is not None:
            ctx = dataclasses.replace(ctx, dims={**ctx.dims, "lora": lora})  # validated by the hf family
        self._ctx = ctx
        # Built in fp32 and computed in the scenario's dtype, as the offload baselines keep it:
        # the masters start from the fp32 initial values, not from their bf16 roundings.
        model = ctx.build_model(dtype=torch.float32)
        chunks = int(ctx.options["loss_chunks"])
        if chunks < 1 or (chunks > 1 and not hasattr(model, "loss_chunks")):
            raise ValueError(f"memferry: loss_chunks must be >= 1 and needs a model with sliced-loss support, got {chunks}")
        if chunks > 1:
            model.loss_chunks = chunks
            model.loss_grad_in_forward = bool(ctx.options.get("loss_grad_in_forward", True))
        self._optimizer_alone = measure == "host-optimizer"
        spec = "prefetch" if self._optimizer_alone else ctx.options["plan"]
        cfg = AdamW(**ctx.adamw_kwargs(), max_grad_norm=ctx.options["max_grad_norm"],
                    host_threads=ctx.options["host_threads"], host_kernel=ctx.options["host_kernel"],
                    clip_mode=ctx.options.get("clip_mode", "speculative"),
                    host_order=ctx.options.get("host_order", "deadline"),
                    landing_wait=ctx.options.get("landing_wait", "spin"),
                    clip_fire_rate=ctx.options.get("clip_fire_rate", 0.0),
                    flat_sends=ctx.options.get("flat_sends", False),
                    split_update=ctx.options.get("split_update"),
                    host_piece=ctx.options.get("host_piece"))
        sample = None
        if spec == "auto":  # the scheduler profiles one batch of the scenario's shape under the device cap
            vocab = _vocab(ctx)
            tokens = torch.randint(0, vocab, (ctx.batch, ctx.seq + 1), generator=torch.Generator().manual_seed(ctx.seed))
            sample = (tokens[:, :-1], tokens[:, 1:])
        plan = spec if spec == "auto" else Plan.from_spec(spec, len(model.blocks))
        cap = ctx.backend.memory_cap(ctx.device_index)
        self._switch_before = sys.getswitchinterval()
        if switch is not None:  # from the profile and rehearsal on, as the steps run
            sys.setswitchinterval(float(switch))
        try:
            self.engine = MemFerry(model, optim=cfg, plan=plan, backend=ctx.backend, device=ctx.device_index,
                                   sample=sample, device_budget=cap, memory_margin=float(ctx.options["memory_margin"]),
                                   compute_dtype=ctx.dtype, blocks=model.blocks,  # named: a 1-block model has no list
                                   accumulation_steps=ctx.accumulation_steps,
                                   sum_placement=ctx.options.get("sum_placement", "race"),
                                   freeze_setup=ctx.options.get("freeze_setup"),
                                   compile_blocks=compile_blocks)
        except BaseException:
            sys.setswitchinterval(self._switch_before)
            raise
        if hold == "budget":
            ctx.backend.set_memory_cap(ctx.device_index, cap)
        self._accumulation = ctx.accumulation_steps
        self._compile_blocks = compile_blocks
        # A step that runs out of memory is planned again and run again, as ``xpu train`` does (the row says so).
        self._replanning = ReplanningSteps(self.engine)
        self._plan_note = f"plan={spec}, host kernel {self.engine.optimizer.kernel.name}" + (
            f", loss in {chunks} slices ({'gradients in forward' if model.loss_grad_in_forward else 'recomputed'})"
            if chunks > 1 else "")
        if ctx.accumulation_steps > 1:
            self._plan_note += f", {ctx.accumulation_steps} micro-batches per step"
        if lora is not None:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            self._plan_note += f", LoRA {lora} ({trainable:,} parameters trainable)"
        self._losses: list[torch.Tensor] = []
        self._export_note = ""
        self._first_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        if spec == "auto":
            predicted, rehearsed = self.engine.plan.predicted_step_s, self.engine.plan.rehearsed_step_s
            if predicted is not None:
                self._plan_note += f" (predicted {predicted:.3f} s" + (f", rehearsed {rehearsed:.3f} s)" if rehearsed
                                                                       else ")")
            print(f"memferry plan chosen by the scheduler:\n{self.engine.plan.describe()}", flush=True)
            if self.engine.plan.profile is not None:  # to replay the search elsewhere (StepProfile.from_json)
                print(f"memferry profile: {self.engine.plan.profile.to_json(indent=None)}", flush=True)
        units = self.engine.plan.units
        acts = [u.activations for u in units]
        self._plan_note += ", activations: " + ", ".join(f"{acts.count(a)} {a}" for a in sorted(set(acts)))
        summing = sum(u.accumulate == "device" for u in units)
        if summing:
            self._plan_note += f", {summing} of {len(units)} blocks sum micro-batches on the device"
        if self._optimizer_alone:
            self._plan_note = f"host AdamW alone over every unit, host kernel {self.engine.optimizer.kernel.name}"
            for shadow in self.engine.shadow.shadows:
                shadow.grad_stage.fill_(1e-3)  # gradients "landed"; the values only need to be finite
        self._steps = 0

    @property
    def notes(self) -> str:
        """The plan, and the host optimizer's milliseconds per step by phase."""
        base = self._plan_note + self._replan_note() + self._loss_note() + self._export_note
        if not self._steps:
            return base
        # The last step's updates may still be running: wait, or the per-step averages below
        # would count a part of that step's host work as if it were all of it.
        self.engine.optimizer.wait_all()
        phases = ", ".join(f"{k} {v * 1e3 / self._steps:.1f}" for k, v in self.engine.optimizer.time_s.items())
        eager = "; compiled blocks ran eagerly (no compiled block code ran in the steps)" if (
            self._compiled_runs_per_step() == 0
            and any(compiles(u) for u in self.engine.plan.units)) else ""  # a plan of DHA blocks compiles none
        return f"{base}{eager}; host optimizer ms/step: {phases}{host_note(self._host_rate_metrics())}{self._clip_note()}"

    @property
    def metrics(self) -> dict[str, Any]:
        """The scheduler's ``predicted_step_s`` and ``predicted_peak_gb`` (its margin included;
        plan ``auto``, else None), the rehearsal's last steps' mean (``rehearsal_step_s``: real devices
        and plan ``auto``, else None), the host optimizer's rate, the plan's and host memory's
        floor (:func:`.host_rate.host_metrics`), the training thread's milliseconds per step in
        queuing gradients home (``grad_post_ms_per_step``: about 0 unless a copy blocks; by part and
        its CPU time in ``grad_post_parts_ms_per_step``, ``GradientPost.parts``), the
        threads issuing device work (this one, and autograd's that sent gradients) waiting for a
        core (``issuing_wait_ms_per_step``: Linux's run delay; 0 elsewhere), and with
        clipping each step's ``grad_norms`` and whether it ``clipped``, and the step predicted after
        a clipped one (``predicted_after_clip_step_s``: :func:`~strategies.memferry.cost.predict_clip_fired`),
        and per step the host's work and the training thread's wait for it (:meth:`_per_step_ms`);
        ``replans``: steps that ran out of device memory, were planned again and ran again
        (``oom_recovery.ReplanningSteps``, as in ``xpu train``); with ``compile_blocks``, how many
        times a step ran compiled block code (``compiled_runs_per_step``; 0: the blocks ran eagerly)."""
        if not self._steps:
            return {}
        self.engine.optimizer.wait_all()
        cfg = self.engine.cfg
        peak = self.engine.plan.predicted_peak_bytes
        clip = {}
        if cfg.max_grad_norm is not None:  # per step, to time the steps that clipped apart (worker.py)
            history = self.engine.grad_norm_history
            clip = {"grad_norms": [round(n, 5) for n, _ in history], "clipped": [c != 1.0 for _, c in history]}
            profile = self.engine.plan.profile
            if profile is not None:  # what a step after a clipped one should take, by the cost model
                links = links_from_probe(self._ctx.backend, self._ctx.device_index)
                clip["predicted_after_clip_step_s"] = predict_clip_fired(self.engine.plan, profile, links).step_s
        post = self.engine.executor.post  # the training thread's time queuing gradients home
        waited = waited_s(self._waits0, run_delays(), post.threads | {self._main_thread})
        if self._compile_blocks:
            clip["compiled_runs_per_step"] = round(self._compiled_runs_per_step(), 2)
        return {**clip, "replans": self._replanning.replans,
                "grad_post_ms_per_step": round(post.seconds * 1e3 / self._steps, 3),
                "grad_post_parts_ms_per_step": {k: round(v * 1e3 / self._steps, 3) for k, v in post.parts.items()},
                "issuing_wait_ms_per_step": round(waited * 1e3 / self._steps, 3),
                "predicted_step_s": self.engine.plan.predicted_step_s,
                "rehearsal_step_s": self.engine.plan.rehearsed_step_s,
                "predicted_peak_gb": None if peak is None else round(peak / 1e9, 4), **self._host_rate_metrics(),
                **self._host_parts(), **self._per_step_ms()}

    def _compiled_runs_per_step(self) -> float | None:
        """Runs of compiled block code per step since the first (``compiled_blocks.compiled_runs``;
        0 where dynamo ran the blocks eagerly), None without ``compile_blocks``."""
        return (compiled_runs() - self._runs0) / self._steps if self._compile_blocks else None

    def _host_parts(self) -> dict[str, float]:
        """The host's work per updated parameter in two parts, measured and as the plan priced
        them (``host_calibration.py``): the updates once the last gradient has landed, and the
        earlier micro-batches' sums (ns per parameter; nothing before any update)."""
        split = self.engine.optimizer.split_since(HostReading(0.0, 0, 0.0))
        plan = self.engine.plan
        out = {} if split is None else {"host_update_ns_per_param": round(split[0] * 1e9, 4),
                                        "host_earlier_ns_per_param": round(split[1] * 1e9, 4)}
        if plan.host_s_per_param:
            out.update(host_planned_update_ns_per_param=round(plan.host_update_s_per_param * 1e9, 4),
                       host_planned_earlier_ns_per_param=round((plan.host_earlier_s_per_param or 0.0) * 1e9, 4))
        return out

    def _host_rate_metrics(self) -> dict[str, Any]:
        """The host optimizer's rate against the plan's and host memory's floor
        (:func:`.host_rate.host_metrics`): what the notes quote of :attr:`metrics` (after
        ``optimizer.wait_all()``)."""
        cfg = self.engine.cfg
        host = [s for s in self.engine.shadow.shadows if s.home == "host"]
        summed = sum(s.master.numel() for s in host if s in self.engine.executor.sums)
        return host_metrics(*self.engine.host_rate(), self._ctx.dtype, self._accumulation,
                            cfg.clip_mode if cfg.max_grad_norm is not None else "", self._ctx.backend,
                            summed / max(1, sum(s.master.numel() for s in host)), split=self.engine.shadow.split)

    def _clip_note(self) -> str:
        """With clipping: where norms were summed, how many steps clipped, and how many speculative
        updates rolled back or were not started (the step was sure to clip)."""
        if self.engine.cfg.max_grad_norm is None:
            return ""
        c = self.engine.clip_stats()
        where = "device" if self.engine.clip.on_device else "host"
        return (f"; clip {self.engine.cfg.clip_mode}, norms on the {where}: {c['clipped_steps']} of {c['steps']} "
                f"steps clipped, {c['rollback_steps']} rolled back ({c['rolled_back_units']} unit updates redone, "
                f"{c['sure_units']} not speculated in steps sure to clip, {c['held_units']} held for want of "
                f"backup room)")

    def _replan_note(self) -> str:
        """Steps that ran out of device memory and ran again, with what each re-plan did."""
        n = self._replanning.replans
        return f"; {n} step(s) ran out of memory and ran again: " + "; then ".join(self._replanning.notes) if n else ""

    def _loss_note(self) -> str:
        """First and last step loss (does the loss fall?)."""
        if len(self._losses) < 2:
            return ""
        return f"; loss {float(self._losses[0]):.4f} -> {float(self._losses[-1]):.4f} over {len(self._losses)} steps"

    def wrap_up(self) -> None:
        """With option ``export_hf``: export, reload with ``from_pretrained``, compare losses (see the module)."""
        if self._export and self._first_batch is not None:
            from .hf_export_check import export_and_reload

            self._export_note = "; " + export_and_reload(self.engine, self._ctx, *self._first_batch)

    def finish(self) -> None:
        """Wait for the host optimizer's pending updates."""
        self.engine.optimizer.wait_all()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self._steps += 1
        if self._steps == 1:  # the threads' waits for a core from here on (metrics)
            self._waits0, self._main_thread = run_delays(), threading.get_native_id()
            self._clock0, self._per_step = self._host_clock(), []
            self._runs0 = compiled_runs()
        if self._optimizer_alone:
            optimizer = self.engine.optimizer
            with phase("optimizer"):
                for i, shadow in enumerate(self.engine.shadow.shadows):
                    if shadow.home == "host":
                        optimizer.submit(i, _landed)
                optimizer.finish_step()
                optimizer.wait_all()
            return None
        if self._first_batch is None and self._export:
            rows = inputs.shape[0] // self._accumulation
            self._first_batch = (inputs[:rows], targets[:rows])
        loss = self._replanning.run(lambda: engine_step(self.engine, inputs, targets, self._accumulation))
        self._losses.append(loss)  # a device scalar: read when the notes are
        self._per_step.append(self._host_clock())
        return loss

    def _host_clock(self) -> tuple[float, float]:
        """Seconds so far of host optimizer work (``HostClock.work_s``) and of the training thread
        waiting for it (``consumer_wait``): read at each step's end for the per-step figures."""
        clock = self.engine.optimizer.clock
        return clock.work_s(), clock.time_s["consumer_wait"]

    def _per_step_ms(self) -> dict[str, list[float]]:
        """Per step, in ms: the host optimizer's work done and the training thread's wait for it
        between the step's start and its end (updates running on past a step's end count to the
        next), to tell a step slowed by the host from one slowed elsewhere (steps vary by 30 %
        on some leases: bench/results/2026-12-05-h100-session32/)."""
        marks = [self._clock0, *self._per_step]
        return {"host_work_ms_steps": [round((b[0] - a[0]) * 1e3, 2) for a, b in zip(marks, marks[1:])],
                "consumer_wait_ms_steps": [round((b[1] - a[1]) * 1e3, 2) for a, b in zip(marks, marks[1:])]}

    def close(self) -> None:
        self.engine.close()
        sys.setswitchinterval(self._switch_before)


def _vocab(ctx: SystemContext) -> int:
    """The model's vocabulary size (an ``hf`` model's from its config or folder)."""
    if ctx.family == "hf":
        from strategies.models.hf_config import hf_config_dict

        return int(hf_config_dict(ctx.dims).get("vocab_size", 256))
    return int(ctx.dims.get("vocab", 256))


def _landed() -> None:
    """A gradient that is already in host memory (the host optimizer measured alone)."""


def make(ctx: SystemContext) -> MemFerrySystem:
    """Factory registered as ``memferry``."""
    return MemFerrySystem(ctx)
