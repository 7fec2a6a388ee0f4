"""`xpu train` under faults and bad input: mixed runs, corrupt/truncated checkpoints, killed writes,
a full disk, a diverging loss, a resume with changed settings (cpu backend, a 1-layer model)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from strategies.training import (CheckpointWriteError, TrainCallback, TrainConfigError, TrainingDivergedError,
                                 load_config, read_checkpoint, train)
from strategies.training import checkpoints as ck

ROOT = Path(__file__).resolve().parent.parent
MICRO = {"family": "gpt", "layers": 1, "hidden": 32, "heads": 2, "vocab": 64}


def _cfg(ckdir: Path | None = None, **extra) -> dict:
    cfg = {"model": dict(MICRO), "strategy": "torch", "steps": 4, "batch": 2, "seq": 8, "log_every": 1,
           "data": {"kind": "synthetic", "branching": 2}}
    if ckdir is not None:
        cfg["checkpoint"] = {"every": 1, "dir": str(ckdir)}
    cfg.update(extra)
    return cfg


def _run(cpu_backend, cfg: dict, callback: TrainCallback | None = None):
    return train(load_config(cfg), callback, backend=cpu_backend)


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


# ---------------------------------------------------------------------------------- 1. run identity
def test_a_fresh_run_into_a_used_folder_is_refused_before_anything_is_built(cpu_backend, tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=2))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    import strategies.models

    def no_build(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(strategies.models, "build_model", no_build)
    with pytest.raises(TrainConfigError) as exc:
        _run(cpu_backend, _cfg(d, steps=2))
    msg = _one_line(exc)
    assert str(d) in msg and f"--resume {d}" in msg and "--overwrite" in msg and "another checkpoint.dir" in msg
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing touched


def test_overwrite_deletes_the_old_run_and_the_run_id_is_kept_across_resumes(cpu_backend, tmp_path):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=3))
    old_id = read_checkpoint(d / "step-0000003.pt")["run_id"]
    _run(cpu_backend, _cfg(d, steps=2, checkpoint={"every": 1, "dir": str(d), "overwrite": True}))
    assert _names(d) == ["step-0000001.pt", "step-0000002.pt"]  # the old step-3 is gone
    new_id = read_checkpoint(d / "step-0000002.pt")["run_id"]
    assert new_id != old_id and len(new_id) == 32
    _run(cpu_backend, _cfg(d, steps=3, resume=str(d)))  # resume into its own folder: allowed, same id
    assert read_checkpoint(d / "step-0000003.pt")["run_id"] == new_id


def test_resume_takes_the_newest_run_and_refuses_writing_among_another_runs_files(cpu_backend, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(cpu_backend, _cfg(a, steps=3))  # run A: steps 1-3, older
    _run(cpu_backend, _cfg(b, steps=1))  # run B: step 1, newer
    os.replace(b / "step-0000001.pt", a / "step-0000001.pt")  # B's step 1 lands among A's files
    run_b = read_checkpoint(a / "step-0000001.pt")["run_id"]
    assert ck.find_checkpoint(a) == a / "step-0000001.pt"  # the newest written, though A has a higher step
    with pytest.raises(TrainConfigError, match="checkpoints of another run"):  # resuming B would write among A's
        _run(cpu_backend, _cfg(a, steps=4, resume=str(a)))
    res = _run(cpu_backend, _cfg(tmp_path / "c", steps=2, resume=str(a)))
    assert res.info.start_step == 1 and read_checkpoint(tmp_path / "c" / "step-0000002.pt")["run_id"] == run_b


def test_overwrite_flag_on_the_cli(cpu_backend, tmp_path):
    """The command line refuses a used folder and ``--overwrite`` replaces its run. The run that
    fills the folder first is the same config file trained in this process: a plain run through
    the command line is checked in test_train_cli.py, and each process start costs seconds."""
    d = tmp_path / "ck"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_cfg(d, steps=1)))
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT))

    def xpu_train(*args):
        return subprocess.run([sys.executable, "-m", "xpu", "train", str(tmp_path / "run.yaml"), "--no-progress", *args],
                              env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)

    train(load_config(tmp_path / "run.yaml"), backend=cpu_backend)
    old_id = read_checkpoint(d / "step-0000001.pt")["run_id"]
    refused = xpu_train()
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1 and "--overwrite" in refused.stderr
    again = xpu_train("--overwrite")
    assert again.returncode == 0, again.stderr
    assert _names(d) == ["step-0000001.pt"] and read_checkpoint(d / "step-0000001.pt")["run_id"] != old_id


# ---------------------------------------------------------------------------------- 2. checksums
def test_flipped_bytes_are_refused_with_the_file_named(cpu_backend, tmp_path):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=2))
    f = d / "step-0000002.pt"
    raw = bytearray(f.read_bytes())
    raw[-600] ^= 0xFF  # one byte deep in the tensor payload (the last 512 are the header)
    f.write_bytes(bytes(raw))
    with pytest.raises(TrainConfigError) as exc:
        _run(cpu_backend, _cfg(steps=4, resume=str(d)))
    msg = _one_line(exc)
    assert str(f) in msg and "checksum mismatch: the file is corrupt; resume from an earlier step-N.pt or start over" in msg
    res = _run(cpu_backend, _cfg(steps=4, resume=str(d / "step-0000001.pt")))  # the earlier one still works
    assert res.info.start_step == 1


@pytest.mark.parametrize("keep_bytes, reason", [(0, "empty (0 bytes)"), (3, "is truncated inside its first bytes"),
                                                (5, "is truncated: its header, written last, is missing"),
                                                (-500, "is truncated: its header, written last, is missing"),
                                                (-1000, "is truncated: its header, written last, is missing")])
def test_truncated_or_empty_files_say_why(cpu_backend, tmp_path, keep_bytes, reason):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=1))
    f = d / "step-0000001.pt"
    raw = f.read_bytes()
    f.write_bytes(raw[:keep_bytes] if keep_bytes >= 0 else raw[:keep_bytes])
    with pytest.raises(TrainConfigError) as exc:
        _run(cpu_backend, _cfg(steps=2, resume=str(f)))
    msg = _one_line(exc)
    assert str(f) in msg and reason in msg


# ---------------------------------------------------------------------------------- 3. tmp files, keep
def test_stale_tmp_files_are_removed_and_keep_prunes_to_the_last_n(cpu_backend, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that has exited: its write was killed
    stale = d / f".step-0000002.pt.tmp-{dead.pid}"
    stale.write_bytes(b"half a checkpoint")
    res = _run(cpu_backend, _cfg(steps=5, checkpoint={"every": 1, "dir": str(d), "keep": 2}))
    assert len(res.checkpoints) == 5
    assert _names(d) == ["step-0000004.pt", "step-0000005.pt"]  # no tmp, only the last two


def test_keep_must_be_a_positive_integer():
    with pytest.raises(TrainConfigError, match="checkpoint.keep must be a positive integer"):
        load_config(_cfg(checkpoint={"dir": "x", "keep": 0}))


def test_saves_fsync_the_file_before_the_rename_and_the_folder_after(cpu_backend, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(ck.os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                    real_fsync(fd))[1])
    monkeypatch.setattr(ck.os, "replace", lambda a, b: (events.append(("replace", None)), real_replace(a, b))[1])
    _run(cpu_backend, _cfg(tmp_path / "ck", steps=1))
    assert events == [("fsync", False), ("replace", None), ("fsync", True)]


# ---------------------------------------------------------------------------------- 4. disk full
@pytest.mark.parametrize("fault", ["enospc", "short-write"])
def test_a_full_disk_keeps_the_earlier_checkpoints_and_removes_the_partial_file(cpu_backend, tmp_path, monkeypatch,
                                                                               fault):
    d = tmp_path / "ck"
    real_write = ck.write_streamed
    calls = []

    def failing_write(tmp, payload, header):
        calls.append(tmp)
        real_write(tmp, payload, header)
        if len(calls) < 3:
            return
        with open(tmp, "r+b") as f:  # what a full disk leaves behind
            f.truncate(tmp.stat().st_size // 2)
        if fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/3: file write failed, unexpected pos 64 vs 128")

    monkeypatch.setattr(ck, "write_streamed", failing_write)
    with pytest.raises(CheckpointWriteError) as exc:
        _run(cpu_backend, _cfg(d, steps=4))
    msg = _one_line(exc)
    assert str(d) in msg and "step-0000003.pt" in msg and "earlier checkpoints there are kept" in msg
    assert ("no space left on device" in msg) if fault == "enospc" else ("unexpected pos" in msg)
    assert _names(d) == ["step-0000001.pt", "step-0000002.pt"]  # no partial tmp, no step 3
    assert read_checkpoint(d / "step-0000002.pt")["step"] == 2  # intact


# ---------------------------------------------------------------------------------- 5. divergence
@pytest.mark.parametrize("strategy", ["torch", "memferry"])
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(cpu_backend, tmp_path, strategy):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=2, strategy=strategy))
    with pytest.raises(TrainingDivergedError) as exc:  # lr 1e20: weights ~1e20 after one update, q.k ~1e42 overflows fp32
        _run(cpu_backend, _cfg(d, steps=6, strategy=strategy, resume=str(d), optimizer={"lr": 1e20}))
    msg = _one_line(exc)
    step = int(msg.split()[1].rstrip(":"))
    assert 3 <= step <= 6 and "the last good checkpoint" in msg and "is kept" in msg
    for f in d.glob("step-*.pt"):  # every checkpoint written holds a finite state
        state = read_checkpoint(f)["engine"]
        assert all(t.isfinite().all() for t in state["model"].values()), f
    assert max(int(f.stem.split("-")[1]) for f in d.glob("step-*.pt")) < step


# ---------------------------------------------------------------------------------- 6. resume with changes
@pytest.mark.parametrize("change, what", [({"seq": 4}, "seq=8"), ({"batch": 3}, "batch=2"), ({"dtype": "bf16"}, "fp32"),
                                          ({"data": {"kind": "synthetic", "branching": 3}}, "data="),
                                          ({"seed": 5}, "seed=0")])
def test_resume_refuses_changes_that_break_the_run(cpu_backend, tmp_path, change, what):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=1))
    with pytest.raises(TrainConfigError) as exc:
        _run(cpu_backend, _cfg(steps=2, resume=str(d), **change))
    msg = _one_line(exc)
    assert what in msg and "start a fresh run" in msg


def test_resume_with_a_new_lr_or_clipping_goes_on_with_a_notice(cpu_backend, tmp_path):
    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=1, strategy="memferry"))

    class Notes(TrainCallback):
        def __init__(self):
            self.notes = []

        def on_notice(self, message):
            self.notes.append(message)

    notes = Notes()
    res = _run(cpu_backend, _cfg(steps=2, resume=str(d), optimizer={"lr": 5e-4, "weight_decay": 0.0},
                                 strategy={"name": "memferry", "options": {"max_grad_norm": 0.5}}), notes)
    assert res.steps == [2] and len(notes.notes) == 1
    assert ("optimizer.lr: 0.001 -> 0.0005" in notes.notes[0] and "optimizer.weight_decay: 0.01 -> 0.0" in notes.notes[0]
            and "max_grad_norm" in notes.notes[0] and "\n" not in notes.notes[0])
    silent = Notes()
    _run(cpu_backend, _cfg(steps=2, resume=str(d), strategy="memferry"), silent)
    assert silent.notes == []


def test_a_state_gone_non_finite_after_a_finite_loss_is_not_saved(cpu_backend, tmp_path, monkeypatch):
    """The loss is computed before the step's update: an update to inf must still not become a checkpoint."""
    from strategies.training.engines import TorchEngine

    real = TorchEngine.state_dict

    def poisoned(self):
        state = real(self)
        next(iter(state["model"].values())).fill_(float("inf"))
        return state

    d = tmp_path / "ck"
    _run(cpu_backend, _cfg(d, steps=1))
    monkeypatch.setattr(TorchEngine, "state_dict", poisoned)
    with pytest.raises(TrainingDivergedError) as exc:
        _run(cpu_backend, _cfg(d, steps=3, resume=str(d)))
    msg = _one_line(exc)
    assert msg.startswith("step 2: model.") and "without writing step-0000002.pt" in msg and str(d) in msg
    assert _names(d) == ["step-0000001.pt"]


def test_a_real_full_disk(cpu_backend, tmp_path):
    """A tmpfs too small for a third checkpoint, in a private mount namespace (skipped where unshare is not allowed)."""
    import shutil

    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                           capture_output=True, text=True, timeout=30) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no private tmpfs here (unshare -rm + mount): {probe.stderr.strip() if probe else 'no unshare'}")
    one = Path(_run(cpu_backend, _cfg(tmp_path / "probe", steps=1)).checkpoints[0]).stat().st_size
    mnt = tmp_path / "disk"
    mnt.mkdir()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(mnt / "ck", steps=4)))
    pages = (int(one * 2.5) // 4096 + 1) * 4096  # room for two checkpoints, not three
    script = (f"mount -t tmpfs -o size={pages} tmpfs {mnt} && {sys.executable} -m xpu train {cfg} --no-progress; "
              f"echo rc=$?; ls -a {mnt / 'ck'}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT)))
    err = [line for line in proc.stderr.strip().splitlines() if "error" in line]
    print(proc.stderr)
    assert "rc=2" in proc.stdout, proc.stdout + proc.stderr
    assert len(err) == 1 and "no space left on device" in err[0] and "step-0000003.pt" in err[0], proc.stderr
    listed = proc.stdout.split("rc=2", 1)[1].split()
    assert sorted(n for n in listed if n not in (".", "..")) == ["step-0000001.pt", "step-0000002.pt"]
