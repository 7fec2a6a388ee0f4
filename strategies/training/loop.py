"""The training loop: build what the config names, then step, log and checkpoint (:func:`train`)."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from .checkpoints import check_checkpoint_dir, load_checkpoint, new_run_id, prepare_checkpoint_dir, save_checkpoint
from .config import TrainConfig, TrainConfigError, TrainingDivergedError, resolve_dtype
from .data import IterableBatches, make_datasets
from .distributed import Launch, join
from .registry import TrainEngine, get_strategy
from .reports import CallbackList, RunInfo, StepReport, TrainCallback, TrainResult
from .schedule import lr_at

__all__ = ["train"]


def train(config: TrainConfig, callback: TrainCallback | None = None, backend: Any = None,
          data: Iterable[Any] | None = None) -> TrainResult:
    """Train ``config.model`` with ``config.strategy`` for ``config.steps`` steps (continuing a checkpoint if ``resume``).

    Each step draws ``config.accumulation_steps`` micro-batches of ``config.batch`` rows and makes
    one update from the gradient of their mean loss. ``data``: any iterable of ``(inputs, targets)``
    or of dicts with ``input_ids`` (and ``labels``; without them targets are ``input_ids`` shifted);
    when given, ``config.data`` is not used for training (only for the held-out eval batches when
    ``eval_every`` is set), and a resumed run cannot put the iterable back at its position (it
    starts from its beginning; a notice says so). With ``eval_every: K`` the mean loss over the
    fixed held-out batches is computed every K steps and after the last one.

    Under ``torchrun`` with several ranks (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set) each rank
    trains data-parallel on device ``LOCAL_RANK``: ``config.batch`` is per rank, so N ranks train
    as one process with N times the batch (see :mod:`.distributed`); only rank 0 calls
    ``callback`` and writes checkpoints; losses are the ranks' mean.

    Everything that can be checked is checked before the model is built: the config
    (already, by :func:`load_config`), the device budget against the device, the resume
    checkpoint against the config, the data file. The process-wide device memory cap is put
    back as it was when the run ends.

    Raises:
        TrainConfigError: a budget larger than the device, an unusable checkpoint, a checkpoint.dir of another run.
        CheckpointWriteError: a checkpoint could not be written (the earlier ones are kept).
        TrainingDivergedError: the loss became NaN or infinite (that state is not checkpointed).
        torch.OutOfMemoryError: the run needs more device memory than the budget.
    """
    import xpu

    from .log_sinks import make_sinks

    config.validate()  # idempotent; covers a TrainConfig built directly rather than by load_config
    sinks = make_sinks(config)  # `logging:`'s CSV / TensorBoard / W&B writers (none off rank 0); they open in on_start
    callback = CallbackList([callback or TrainCallback(), *sinks]) if sinks else (callback or TrainCallback())
    backend = backend or xpu.get_backend()
    spec = get_strategy(config.strategy.name)
    launch = join(backend, config.strategy.name, spec.data_parallel)  # None: one process (not under torchrun)
    try:
        return _train(config, callback if launch is None or launch.leader else TrainCallback(), backend, data,
                      spec, launch)
    finally:
        if launch is not None:
            launch.close()


def _train(config: TrainConfig, callback: TrainCallback, backend: Any, data: Iterable[Any] | None, spec: Any,
           launch: Launch | None) -> TrainResult:
    """:func:`train` once the process group (if any) is joined."""
    import xpu
    from strategies.models import build_model

    world = launch.world if launch is not None else 1
    leader = launch is None or launch.leader
    device = launch.device if launch is not None else backend.index_of(None)
    budget = config.device_budget  # bytes: validate() parsed it
    total = next(d.total_bytes for d in backend.topology().devices if d.index == device)
    if budget is not None and budget > total:
        raise TrainConfigError(f"device_budget {xpu.format_bytes(budget)} exceeds device {device}'s "
                               f"{xpu.format_bytes(total)} on the {backend.name} backend")
    dtype_name, dtype = resolve_dtype(config, backend)
    # Data-parallel: every rank draws the global batch (world x batch rows) and trains on its share
    # (Launch.shard); checkpoints record that global batch, the data stream's, so any split resumes them.
    global_config = dataclasses.replace(config, batch=config.batch * world) if world > 1 else config
    resumed_from, state, notices = load_checkpoint(global_config, dtype_name) if config.resume else (None, None, [])
    run_id = state["run_id"] if state is not None else new_run_id()  # kept across resumes: one run, one id
    if config.checkpoint is not None:
        check_checkpoint_dir(config, run_id, fresh=state is None)
        try:  # an unwritable folder fails now, not after the first hour of training
            Path(config.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainConfigError(f"checkpoint.dir {config.checkpoint.dir!r}: {exc.strerror or exc}") from None
    windows, eval_batches, data_desc = make_datasets(global_config)  # may raise: a token id the vocab cannot hold, ...
    if data is not None:
        batches: Any = IterableBatches(data)
        data_desc = "batches from the caller's iterable" + (f" (eval: {data_desc})" if eval_batches else "")
        if state is not None:
            notices.append("resume: the data iterable cannot be restored to its position; it starts from its "
                           "beginning, so the resumed steps see other batches than an uninterrupted run")
    else:
        batches = windows
    del windows
    if launch is not None:
        data_desc += (f"; data-parallel over {world} ranks (torchrun): batch {config.batch} per rank, "
                      f"{config.batch * world} in all")
        eval_batches = [launch.shard(b) for b in eval_batches]
    accum = config.accumulation_steps

    # Seed a private copy of the host RNG: the same config builds the same initial weights
    # whatever the caller did before, and the caller's RNG stream is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(config.family, dtype=torch.float32 if spec.fp32_model else dtype, **config.model_dims())
    params = sum(p.numel() for p in model.parameters())

    previous_cap = backend.memory_cap(device)
    engine: TrainEngine | None = None
    result: TrainResult | None = None
    try:
        if budget is not None and not spec.takes_budget:
            backend.set_memory_cap(device, budget)
        engine = spec.build(model, config, backend, device)
        backend.reset_peak_memory(device)  # after set-up: a scheduler's profiling step is not the run
        start = 0
        if state is not None:
            engine.load_state_dict(state["engine"])
            batches.load_state_dict(state["data"])
            start = int(state["step"])
        del model, state
        if config.checkpoint is not None and leader:  # only now that the run is built: a failed build deletes nothing
            prepare_checkpoint_dir(config, run_id)
        for notice in notices:
            callback.on_notice(notice)
        info = RunInfo(config.name, backend.name, device, dtype_name, params, config.strategy.name,
                       dict(config.strategy.options), budget, data_desc, start, config.steps,
                       config.batch * world * config.seq * accum, str(resumed_from) if resumed_from else None,
                       engine.plan.describe() if config.strategy.options.get("plan") == "auto" else None, run_id,
                       world, padded=data is None and not config.data.packing)
        callback.on_start(info)
        steps, losses, lrs, times, checkpoints, eval_losses, tokens = [], [], [], [], [], [], []
        every = config.checkpoint.every if config.checkpoint else 0
        t_begin = time.perf_counter()
        for i in range(start, config.steps):
            lr = lr_at(config.optimizer, i, config.steps)
            engine.set_lr(lr)
            micro = [batches.next() for _ in range(accum)]
            tokens.append(sum(x.numel() for x, _ in micro))  # every rank's: drawn whole, then sharded
            if launch is not None:
                micro = [launch.shard(b) for b in micro]
            t0 = time.perf_counter()
            # one micro-batch: train_step, exactly as before accumulation existed
            out = engine.train_step(*micro[0]) if accum == 1 else engine.train_batch(micro)
            # reading it back waits for this step's forward; data-parallel: the mean over ranks (one global batch)
            loss = float(out) if launch is None else launch.mean(out, backend.device(device))
            step_s = time.perf_counter() - t0
            n = i + 1
            if not math.isfinite(loss):  # checked before saving: a NaN state never becomes a checkpoint
                last = checkpoints[-1] if checkpoints else resumed_from
                kept = f"the last good checkpoint {last} is kept" if last else "no checkpoint was written"
                raise TrainingDivergedError(f"step {n}: the loss is {loss} (diverged); the run stopped and {kept}; "
                                            f"lower optimizer.lr or set strategy.options.max_grad_norm, then resume")
            saved = None
            if config.checkpoint is not None and ((every and n % every == 0) or n == config.steps):
                if leader:
                    saved = str(save_checkpoint(Path(config.checkpoint.dir), n, engine, batches, global_config, run_id,
                                                dtype_name, config.checkpoint.keep))
                    checkpoints.append(saved)
                else:
                    engine.state_dict()  # a collective: the leader's state gathers every rank's shards
            steps.append(n)
            losses.append(loss)
            lrs.append(lr)
            times.append(step_s)
            eval_loss = None
            if config.eval_every and eval_batches and (n % config.eval_every == 0 or n == config.steps):
                eval_loss = sum(engine.eval_loss(x, y) for x, y in eval_batches) / len(eval_batches)
                if launch is not None:  # each rank's share of every eval batch: their mean is the batches' mean
                    eval_loss = launch.mean(eval_loss, backend.device(device))
                eval_losses.append((n, eval_loss))
            peak = backend.memory_stats(device).peak_reserved
            callback.on_step(StepReport(n, config.steps, loss, lr, step_s, peak,
                                        log=n % config.log_every == 0 or n == config.steps or n == start + 1,
                                        checkpoint=saved, eval_loss=eval_loss, tokens=tokens[-1]))
        engine.synchronize()
        wall = time.perf_counter() - t_begin
        stats = backend.memory_stats(device)
        step_total = sum(times)
        result = TrainResult(steps, losses, lrs, times, stats.peak_reserved, stats.peak_allocated, wall,
                             sum(tokens) / step_total if step_total else 0.0, checkpoints, info, eval_losses)
        return result
    finally:
        try:
            if engine is not None:
                engine.close()
            if backend.memory_cap(device) != previous_cap:
                backend.set_memory_cap(device, previous_cap)
        finally:
            _end(callback, result)


def _end(callback: TrainCallback, result: TrainResult | None) -> None:
    """``callback.on_end``; after a failed run its own error must not hide the run's."""
    if result is not None:
        callback.on_end(result)
        return
    try:
        callback.on_end(None)
    except Exception:  # noqa: BLE001 - the run's exception is the one to see
        import logging

        logging.getLogger("strategies.training").exception("a callback's on_end failed after the run failed")
