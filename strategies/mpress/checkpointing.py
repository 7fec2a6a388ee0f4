"""Checkpoints of ``xpu mpress``: every stage's weights and AdamW state in one ``xpu train`` checkpoint file.

A stage keeps the whole model's parameter names (``blocks.7.fc.weight``: :mod:`.stages`), so each
rank's part is named as in the unpipelined model and the parts merge into one state by name:

* save (every ``checkpoint.every`` steps and after the last): each rank copies its weights and
  AdamW state to host memory, rank 0 gathers them over the host library (gloo, not the device
  library: the device holds none of it) and writes ``step-N.pt`` through
  :func:`strategies.training.checkpoints.save_checkpoint` (atomic, checksummed, run identity,
  ``keep``), with the data position and the config, its strategy recorded as ``mpress``;
* resume: every rank reads the file and takes its own names, so a run may resume under other
  stage counts, block splits, micro-batch counts or schedules (they change how the step is
  computed, not what); the checks of ``xpu train``'s resume refuse other models, shapes, data or
  dtype, before any process starts (:func:`check_resume`).

The file's engine state is ``{"model": {name: tensor}, "optimizer": {name: {step, exp_avg,
exp_avg_sq}}}``: AdamW's state by parameter name, not by torch's per-stage parameter index.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from strategies.training import TrainConfig, TrainConfigError

__all__ = ["stage_state", "load_stage_state", "merge_states", "record_config", "check_resume", "save_merged"]

#: The strategy name an mpress checkpoint records (``xpu train`` records its own).
STRATEGY = "mpress"


def _host(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def stage_state(stage: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Host copies of ``stage``'s weights and of its AdamW state, both by the whole model's parameter names."""
    names = {p: n for n, p in stage.named_parameters()}
    return {"model": {n: _host(t) for n, t in stage.state_dict().items()},
            "optimizer": {names[p]: {k: _host(v) for k, v in s.items()} for p, s in optimizer.state.items()}}


def merge_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine state from every stage's :func:`stage_state` (names are disjoint across stages)."""
    merged: dict[str, Any] = {"model": {}, "optimizer": {}}
    for part in parts:
        merged["model"].update(part["model"])
        merged["optimizer"].update(part["optimizer"])
    return merged


def load_stage_state(stage: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                     source: Path | str) -> None:
    """Load this stage's names of a merged ``state`` into its weights and its (already allocated) AdamW state.

    Raises:
        TrainConfigError: the file lacks some of the stage's names (a file of another model or strategy).
    """
    model, moments = state.get("model"), state.get("optimizer")
    if not isinstance(model, dict) or not isinstance(moments, dict):
        raise TrainConfigError(f"resume: {source} holds no mpress engine state (model and optimizer by name)")
    own = stage.state_dict()
    missing = [n for n in own if n not in model]
    missing += [n for n, p in stage.named_parameters() if p in optimizer.state and n not in moments]
    if missing:
        raise TrainConfigError(f"resume: {source} lacks {len(missing)} of this stage's tensors ({missing[0]}, ...); "
                               f"it was written for another model")
    stage.load_state_dict({n: model[n] for n in own})  # copies into the device tensors in place
    for name, p in stage.named_parameters():
        for key, saved in moments.get(name, {}).items():
            held = optimizer.state[p].get(key)
            if isinstance(held, torch.Tensor) and isinstance(saved, torch.Tensor):
                held.copy_(saved)  # in place: the plan counted these buffers where they are
            else:
                optimizer.state[p][key] = saved


def record_config(train: TrainConfig, options: dict[str, Any]) -> dict[str, Any]:
    """The config dict a checkpoint stores: the train config with ``strategy`` the pipeline's."""
    return {**train.to_dict(), "strategy": {"name": STRATEGY, "options": dict(options)}}


def check_resume(train: TrainConfig, options: dict[str, Any], dtype_name: str,
                 verified: str | None = None) -> tuple[Path, dict[str, Any], list[str], str]:
    """Read and check ``train.resume`` against the config: (file, its contents, notices of allowed
    changes, its ``verified_mark`` taken before it was read: a file changed while it was verified
    no longer matches). ``verified``: the launcher's mark of the file it verified (``read_checkpoint``'s).

    Raises:
        TrainConfigError: unreadable, written by another strategy, or of another model, shapes, data or
            dtype (the messages of ``xpu train``'s resume); or already at ``steps``.
    """
    from strategies.training.checkpoints import (check_steps_left, compare_configs, find_checkpoint, read_checkpoint,
                                                 verified_mark)

    path = find_checkpoint(str(train.resume))
    mark = verified_mark(path)
    state = read_checkpoint(path, verified)
    saved = state["config"]
    strategy = (saved.get("strategy") or {}).get("name") if isinstance(saved, dict) else None
    if strategy != STRATEGY:
        raise TrainConfigError(f"resume: {path} was written by xpu train (strategy {strategy!r}); xpu mpress resumes "
                               f"only its own checkpoints")
    # xpu train's checks and notices, the pipeline options (all may change) compared with the config's.
    as_train = {**saved, "strategy": {**saved["strategy"], "name": train.strategy.name}}
    notices = compare_configs(as_train, state.get("dtype"), train, dtype_name, path, options=options)
    check_steps_left(path, state["step"], train.steps)
    return path, state, notices, mark


class _Merged:
    """What :func:`~strategies.training.checkpoints.save_checkpoint` reads of an engine: its state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        return self._state  # gathered host copies already


def save_merged(train: TrainConfig, options: dict[str, Any], step: int, parts: list[dict[str, Any]], data: Any,
                run_id: str, dtype_name: str) -> Path:
    """Rank 0: write the gathered stage states as ``checkpoint.dir/step-N.pt`` (see the module's text)."""
    from strategies.training.checkpoints import save_checkpoint

    assert train.checkpoint is not None
    return save_checkpoint(Path(train.checkpoint.dir).expanduser(), step, _Merged(merge_states(parts)), data,
                           record_config(train, options), run_id, dtype_name, train.checkpoint.keep)
