"""Checkpoints of ``xpu train``: ``step-N.pt`` files written atomically, checksummed, found and checked on resume.

File layout (format 3; ``checkpoint_file.py``): ``torch.save`` of ``{"engine", "data", "config",
"dtype"}`` as a zip from byte 0, then a JSON header (``format``, ``run_id``, ``step``, ``time``,
``bytes``, ``crc32``) in the file's last 512 bytes. Format 2 files (the header first) still read.

The payload is streamed into a hidden ``.step-N.pt.tmp-PID`` file, its CRC-32 taken as it goes
and the header written last (no serialised copy of the state in memory); the file is fsync'ed,
renamed over ``step-N.pt`` and the folder fsync'ed: a reader sees the old set of files or the new
one, never half a file. A resume checks the CRC in pieces, then maps the payload with
``torch.load(..., weights_only=True, mmap=True)``, so a checkpoint cannot run code and a tensor is
read from the file only where it is used.

Why CRC-32 and not SHA-256: it guards against torn writes and bit rot, not against an attacker
(a checkpoint is trusted input from one's own disk), and ``zlib.crc32`` ran at ~3.0 GB/s against
sha256's ~0.75 GB/s on this host: for an 80 GB optimizer state that is ~30 s rather than ~2 min per save.

Run identity: a fresh run makes a ``run_id`` (uuid4) that every checkpoint of it records and a
resume keeps. A fresh run is refused in a folder that already holds ``step-*.pt`` files unless
``checkpoint.overwrite`` (then they are deleted when the run starts); a resumed run is refused
in a folder holding another run's checkpoints unless ``overwrite``. "The newest checkpoint" of a
folder is the one with the latest header ``time`` (the clock at save; it survives copies, unlike
file mtimes), and resume takes it; ``checkpoint.keep`` prunes only the run's own files.

What a resume may change (:func:`compare_configs`):

* refused (one-line :class:`TrainConfigError`): ``model``, ``strategy.name``, ``seq``, ``batch``,
  ``accumulation_steps``, ``dtype`` (the resolved one), ``data`` (kind, path, branching, field,
  tokenizer, eos_id, dtype, eval_fraction; keys a checkpoint predates count as their defaults) and, for synthetic data, ``seed``:
  they change the shapes, the number format, or the token stream the saved data position points into;
* allowed with a one-line notice (``TrainCallback.on_notice``): the optimizer settings (``lr``,
  ``weight_decay``, ``betas``, ``eps``, ``schedule``, ``warmup_steps``, ``min_lr``) and the other
  strategy options (``max_grad_norm``, ``plan``, ...): they change later updates, not what was saved.
"""
from __future__ import annotations

import errno
import inspect
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .checkpoint_file import load_payload, parse_header, verify_streamed, write_streamed
from .config import CheckpointWriteError, DataConfig, TrainConfig, TrainConfigError, TrainingDivergedError
from .data import TokenWindows
from .registry import TrainEngine

__all__ = ["find_checkpoint", "load_checkpoint", "save_checkpoint", "read_checkpoint", "read_header", "new_run_id",
           "check_checkpoint_dir", "prepare_checkpoint_dir", "compare_configs", "check_steps_left", "CHECKPOINT_FORMAT",
           "verified_mark", "VERIFIED_ENV"]

#: Version of the checkpoint layout.
CHECKPOINT_FORMAT = 3
_GLOB = "step-*.pt"
_TMP_GLOB = ".step-*.pt.tmp-*"
_CORRUPT = "checksum mismatch: the file is corrupt; resume from an earlier step-N.pt or start over"

#: Set by a launcher for the processes it starts, after it verified their checkpoint: its
#: :func:`verified_mark`. ``xpu mpress`` checks the file before torchrun starts the stages; without
#: the mark every stage read the whole file again for its checksum (a 6.58 B-parameter model's
#: state is ~105 GB), though each maps only its own tensors.
VERIFIED_ENV = "XPU_CHECKPOINT_VERIFIED"


def new_run_id() -> str:
    """A fresh run's identity."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------- reading
def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a checkpoint file (format 3 or 2; ``checkpoint_file.py``).

    Raises:
        TrainConfigError: empty, truncated or not a checkpoint; the message names the file and why.
    """
    try:
        return parse_header(path)
    except OSError as exc:
        raise TrainConfigError(f"resume: cannot read checkpoint {path}: {exc.strerror or exc}") from None
    except EOFError as exc:
        raise TrainConfigError(f"resume: checkpoint {path} {exc}; resume from an earlier step-N.pt or start over") \
            from None
    except ValueError as exc:
        raise TrainConfigError(f"resume: {path} is not a readable xpu train checkpoint: {_one_line(exc)}") from None


def verified_mark(path: str | Path) -> str:
    """What identifies the file as it is now (its resolved path, size and modification time in ns):
    a reader given the mark its launcher took before verifying the file, and finding the file
    unchanged, need not verify it again (:data:`VERIFIED_ENV`)."""
    st = os.stat(path)
    return f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def read_checkpoint(path: str | Path, verified: str | None = None) -> dict[str, Any]:
    """Read and verify a checkpoint: its header fields plus the payload (``engine``, ``data``, ``config``, ``dtype``).

    ``verified``: a :func:`verified_mark` taken before this file's checksum passed; if the file
    still matches it, the checksum pass is skipped (the header's own checks still run).

    Raises:
        TrainConfigError: unreadable, truncated, or its checksum does not match (one line naming the file).
    """
    path = Path(path)
    header = read_header(path)
    try:
        if verified is not None and verified == verified_mark(path):
            count, crc = header["bytes"], header["crc32"]
        else:
            count, crc = verify_streamed(path, header["_start"], header["_end"])
    except OSError as exc:
        raise TrainConfigError(f"resume: cannot read checkpoint {path}: {exc.strerror or exc}") from None
    if count != header["bytes"]:
        raise TrainConfigError(f"resume: checkpoint {path} is truncated: {count:,} of {header['bytes']:,} payload "
                               f"bytes; resume from an earlier step-N.pt or start over")
    if crc != header["crc32"]:
        raise TrainConfigError(f"resume: checkpoint {path}: {_CORRUPT}")
    try:
        payload = load_payload(path, header["_start"], header["_end"])
    except Exception as exc:  # a checksum-valid but foreign payload: say so, not a pickle traceback
        raise TrainConfigError(f"resume: cannot read checkpoint {path}: {_one_line(exc)}") from None
    if not isinstance(payload, dict) or "engine" not in payload or "config" not in payload:
        raise TrainConfigError(f"resume: {path} is not an xpu train checkpoint")
    return {**payload, **{k: v for k, v in header.items() if not k.startswith("_")}}


def _headers(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(file, header) of the folder's readable checkpoints, oldest first; unreadable ones are left out."""
    out = []
    for p in directory.glob(_GLOB):
        try:
            out.append((p, read_header(p)))
        except TrainConfigError:
            continue
    return sorted(out, key=lambda ph: (ph[1]["time"], ph[1]["step"]))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or a folder's newest ``step-N.pt`` (latest header time, then highest step).

    Raises:
        TrainConfigError: nothing there, or no readable checkpoint in the folder.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob(_GLOB))
        if not found:
            raise TrainConfigError(f"resume: folder {str(path)!r} holds no step-*.pt checkpoint")
        readable = _headers(p)
        if not readable:
            read_header(max(found, key=lambda q: q.stat().st_mtime))  # raises, naming the newest file and why
        return readable[-1][0]
    if not p.is_file():
        raise TrainConfigError(f"resume: no checkpoint file or folder {str(path)!r}")
    return p


# ---------------------------------------------------------------------------------- resume checks
_REFUSED = {"seq": "the sequence length (shapes)", "batch": "the batch size (the data stream)",
            "accumulation_steps": "the micro-batches per step (the data stream and the effective batch)",
            "data": "the data (the saved data position points into another stream)"}
#: What a checkpoint written before a key existed means by it: the key's default.
_SAVED_DEFAULTS = {"accumulation_steps": 1}


def compare_configs(saved: dict[str, Any], saved_dtype: str | None, config: TrainConfig, dtype_name: str,
                    path: Path, options: dict[str, Any] | None = None) -> list[str]:
    """Refuse a resume that changes what the run computes; return notices for settings that only steer it.

    ``options`` are the strategy options now, where the config does not hold them (``xpu mpress``'s pipeline).

    Raises:
        TrainConfigError: model, strategy, seq, batch, dtype, data or (synthetic) seed differ.
    """
    if saved["model"] != config.model:
        raise TrainConfigError(f"resume: {path} holds model {saved['model']}, the config asks for {config.model}")
    if saved["strategy"]["name"] != config.strategy.name:
        raise TrainConfigError(f"resume: {path} was written by strategy {saved['strategy']['name']!r}; "
                               f"the config uses {config.strategy.name!r}")
    now = config.to_dict()
    for key, what in _REFUSED.items():
        was = saved.get(key, _SAVED_DEFAULTS.get(key))
        if key == "data" and isinstance(was, dict):
            was = {**asdict(DataConfig()), **was}
        if was != now[key]:
            raise TrainConfigError(f"resume: {path} was trained with {key}={was}, the config says "
                                   f"{key}={now[key]}; changing {what} breaks the run: set it back, or start a fresh run")
    if saved_dtype is not None and saved_dtype != dtype_name:
        raise TrainConfigError(f"resume: {path} was trained in {saved_dtype}, this run would use {dtype_name}; "
                               f"set dtype: {saved_dtype} or start a fresh run")
    if config.data.kind == "synthetic" and saved.get("seed") != config.seed:
        raise TrainConfigError(f"resume: {path} was trained with seed={saved.get('seed')}, the config says "
                               f"seed={config.seed}; the seed picks the synthetic corpus: set it back, or start a fresh run")
    changes = [f"optimizer.{k}: {v} -> {now['optimizer'][k]}" for k, v in saved["optimizer"].items()
               if now["optimizer"].get(k) != v]
    options = now["strategy"]["options"] if options is None else options
    changes += [f"strategy.options.{k}: {v} -> {options.get(k)}"
                for k, v in saved["strategy"]["options"].items() if options.get(k) != v]
    return [f"resume: changed since {path.name}: " + "; ".join(changes)] if changes else []


def load_checkpoint(config: TrainConfig, dtype_name: str) -> tuple[Path, dict[str, Any], list[str]]:
    """Read, verify and check the resume checkpoint against the config (before anything is built).

    Returns the file, its contents (with ``run_id`` and ``step``) and the notices of allowed changes.
    """
    path = find_checkpoint(str(config.resume))
    state = read_checkpoint(path)
    notices = compare_configs(state["config"], state.get("dtype"), config, dtype_name, path)
    check_steps_left(path, state["step"], config.steps)
    return path, state, notices


def check_steps_left(path: Path, step: int, steps: int) -> None:
    """Refuse to resume a checkpoint at ``step`` into a run of ``steps`` that has none left."""
    if step >= steps:
        raise TrainConfigError(f"resume: {path} is at step {step}, which already reaches steps={steps}; "
                               f"raise steps to train further")


# ---------------------------------------------------------------------------------- the folder
def check_checkpoint_dir(config: TrainConfig, run_id: str, fresh: bool) -> None:
    """Refuse to mix runs in ``checkpoint.dir`` (called before anything is built; changes nothing).

    Raises:
        TrainConfigError: a fresh run into a folder with ``step-*.pt`` files, or a resumed one into a folder
            holding another run's, without ``checkpoint.overwrite``.
    """
    assert config.checkpoint is not None
    directory = Path(config.checkpoint.dir).expanduser()
    if config.checkpoint.overwrite or not directory.is_dir():
        return
    found = sorted(directory.glob(_GLOB))
    others = found if fresh else [p for p, h in _headers(directory) if h["run_id"] != run_id]
    if others:
        kind = "checkpoints" if fresh else "checkpoints of another run"
        raise TrainConfigError(f"checkpoint.dir {str(directory)!r} already holds {len(others)} {kind} "
                               f"({others[-1].name}, ...); pass `--resume {directory}` to continue it, `--overwrite` "
                               f"(checkpoint.overwrite: true) to delete them and start over, or use another checkpoint.dir")


def _remove_stale_tmps(directory: Path) -> None:
    """Delete ``.step-*.pt.tmp-PID`` files of writers that are gone (a killed save leaves one)."""
    for tmp in directory.glob(_TMP_GLOB):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another live process writing here; not ours to delete
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_checkpoint_dir(config: TrainConfig, run_id: str) -> list[Path]:
    """At the run's start: remove stale temporary files and, with ``overwrite``, other runs' checkpoints.

    Returns the deleted checkpoints.
    """
    assert config.checkpoint is not None
    directory = Path(config.checkpoint.dir).expanduser()
    _remove_stale_tmps(directory)
    if not config.checkpoint.overwrite:
        return []
    ours = {p for p, h in _headers(directory) if h["run_id"] == run_id}
    gone = [p for p in sorted(directory.glob(_GLOB)) if p not in ours]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def _fsync_dir(directory: Path) -> None:
    try:  # makes the rename durable; some file systems cannot open a folder for this, which is no error
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _nonfinite(obj: Any, name: str = "") -> str | None:
    """The dotted name of the first floating tensor in ``obj`` holding a NaN or an infinity, else None."""
    if isinstance(obj, torch.Tensor):
        return name if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _nonfinite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def save_checkpoint(directory: Path, step: int, engine: TrainEngine, data: TokenWindows,
                    config: TrainConfig | dict[str, Any], run_id: str, dtype_name: str, keep: int | None = None) -> Path:
    """Write ``step-N.pt`` atomically and durably, then prune to this run's last ``keep`` checkpoints.

    ``config`` is recorded as its ``to_dict()`` (a dict as given: ``xpu mpress`` records its pipeline).

    Raises:
        CheckpointWriteError: the folder cannot take the file (disk full, read-only, ...); the earlier
            checkpoints are untouched and the partial temporary file is removed.
        TrainingDivergedError: the state holds NaN or infinite values (the step's update diverged
            though its loss, computed before the update, was finite); nothing is written.
    """
    final = directory / f"step-{step:07d}.pt"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    # Written before the next step: the engine's buffers as they are, not a second copy of them
    # (an engine from elsewhere whose state_dict takes no ``copy`` gives its own).
    takes_copy = "copy" in inspect.signature(engine.state_dict).parameters
    state = engine.state_dict(copy=False) if takes_copy else engine.state_dict()
    bad = _nonfinite(state)  # one pass over the tensors, small beside serialising them
    if bad is not None:
        raise TrainingDivergedError(f"step {step}: {bad} holds NaN or infinite values (diverged); the run stopped "
                                    f"without writing {final.name}, the earlier checkpoints in {str(directory)!r} "
                                    f"are kept; lower optimizer.lr or set strategy.options.max_grad_norm, then resume")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmps(directory)
        record = config if isinstance(config, dict) else config.to_dict()
        write_streamed(tmp, {"engine": state, "data": data.state_dict(), "config": record, "dtype": dtype_name},
                       lambda size, crc: {"format": CHECKPOINT_FORMAT, "run_id": run_id, "step": step,
                                          "time": time.time(), "bytes": size, "crc32": crc})
        os.replace(tmp, final)  # atomic on POSIX
        _fsync_dir(directory)
    except (OSError, RuntimeError) as exc:  # RuntimeError: torch's "unexpected pos" when a write comes up short
        reason = os.strerror(exc.errno).lower() if isinstance(exc, OSError) and exc.errno else _one_line(exc)
        hint = "free space there" if getattr(exc, "errno", None) == errno.ENOSPC else "fix the folder"
        raise CheckpointWriteError(f"checkpoint: cannot write {final.name} in {str(directory)!r}: {reason}; "
                                   f"the earlier checkpoints there are kept; {hint} or set another checkpoint.dir, "
                                   f"then resume") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    if keep is not None:
        ours = [p for p, h in _headers(directory) if h["run_id"] == run_id]
        for p in ours[:-keep]:
            p.unlink(missing_ok=True)
    return final
