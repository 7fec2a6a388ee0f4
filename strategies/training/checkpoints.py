"""Checkpoints of ``xpu train``: ``step-N.pt`` files written atomically, found and checked on resume."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig, TrainConfigError
from .data import TokenWindows
from .registry import TrainEngine

__all__ = ["find_checkpoint", "load_checkpoint", "save_checkpoint", "CHECKPOINT_FORMAT"]

#: Version of the checkpoint layout.
CHECKPOINT_FORMAT = 1


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or the highest ``step-N.pt`` in a folder.

    Raises:
        TrainConfigError: nothing there.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("step-*.pt"))
        if not found:
            raise TrainConfigError(f"resume: folder {str(path)!r} holds no step-*.pt checkpoint")
        return found[-1]
    if not p.is_file():
        raise TrainConfigError(f"resume: no checkpoint file or folder {str(path)!r}")
    return p


def load_checkpoint(config: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """Read and check the resume checkpoint against the config (before anything is built)."""
    path = find_checkpoint(str(config.resume))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise TrainConfigError(f"resume: cannot read checkpoint {path}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or "engine" not in state:
        raise TrainConfigError(f"resume: {path} is not an xpu train checkpoint")
    saved = state["config"]
    if saved["model"] != config.model:
        raise TrainConfigError(f"resume: {path} holds model {saved['model']}, the config asks for {config.model}")
    if saved["strategy"]["name"] != config.strategy.name:
        raise TrainConfigError(f"resume: {path} was written by strategy {saved['strategy']['name']!r}; "
                               f"the config uses {config.strategy.name!r}")
    if state["step"] >= config.steps:
        raise TrainConfigError(f"resume: {path} is at step {state['step']}, which already reaches steps={config.steps}; "
                               f"raise steps to train further")
    return path, state


def save_checkpoint(directory: Path, step: int, engine: TrainEngine, data: TokenWindows, config: TrainConfig) -> Path:
    """Write ``step-N.pt`` atomically: a temporary file in the same folder, then a rename."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:07d}.pt"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    payload = {"format": CHECKPOINT_FORMAT, "step": step, "engine": engine.state_dict(), "data": data.state_dict(),
               "config": config.to_dict()}
    try:
        torch.save(payload, tmp)
        os.replace(tmp, final)  # atomic on POSIX: a reader sees the old file set or the new one, never half a file
    finally:
        if tmp.exists():
            tmp.unlink()
    return final
