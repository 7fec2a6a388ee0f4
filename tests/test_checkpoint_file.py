"""Checkpoint files (``strategies/training/checkpoint_file.py``): the bytes on disk, no serialised
copy of the state in memory either way, tensors mapped from the file, and format 2 files still read."""
from __future__ import annotations

import io
import json
import tracemalloc
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from strategies.training.checkpoint_file import TRAILER
from strategies.training.checkpoints import CHECKPOINT_FORMAT, read_checkpoint, read_header, save_checkpoint
from strategies.training.config import TrainConfigError

PAYLOAD = 48 << 20  # bytes of tensors in the state: far above what the streams hold at once


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(PAYLOAD // 8, generator=g)},
            "optimizer": {"w": {"exp_avg": torch.randn(PAYLOAD // 8, generator=g), "step": 3}}}


def _save(tmp_path, state) -> object:
    engine = SimpleNamespace(state_dict=lambda: state)
    data = SimpleNamespace(state_dict=lambda: {"position": 7})
    return save_checkpoint(tmp_path, 5, engine, data, {"name": "t"}, run_id="r1", dtype_name="fp32")


def test_a_saved_checkpoint_reads_back_equal_with_a_checked_header(tmp_path):
    state = _state()
    path = _save(tmp_path, state)
    header = read_header(path)
    assert (header["format"], header["run_id"], header["step"]) == (3, "r1", 5) and CHECKPOINT_FORMAT == 3
    raw = path.read_bytes()
    blob = raw[:header["bytes"]]  # the payload from byte 0, the header in the last TRAILER bytes
    assert (header["_start"], header["_end"], len(raw)) == (0, header["bytes"], header["bytes"] + TRAILER)
    assert zlib.crc32(blob) == header["crc32"]
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True)["engine"]["model"]["w"], state["model"]["w"])
    got = read_checkpoint(path)
    assert torch.equal(got["engine"]["model"]["w"], state["model"]["w"])
    assert torch.equal(got["engine"]["optimizer"]["w"]["exp_avg"], state["optimizer"]["w"]["exp_avg"])
    assert got["engine"]["optimizer"]["w"]["step"] == 3 and got["data"] == {"position": 7}


def test_saving_and_resuming_hold_no_serialised_copy_of_the_state(tmp_path):
    """The earlier writer held the payload's bytes in memory (a BytesIO and its copy: ~2x the
    state) and the reader held them beside the tensors: Python allocations a third of the state
    would already show either."""
    state = _state()
    tracemalloc.start()
    try:
        path = _save(tmp_path, state)
        saved_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        got = read_checkpoint(path)
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert saved_peak < PAYLOAD / 3, saved_peak
    assert read_peak < PAYLOAD / 3, read_peak
    assert torch.equal(got["engine"]["model"]["w"], state["model"]["w"])


def test_a_resumed_tensor_is_mapped_from_the_file_not_copied(tmp_path):
    path = _save(tmp_path, _state())
    got = read_checkpoint(path)["engine"]["model"]["w"]
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps to find the mapping in")
    ptr = got.data_ptr()
    for line in maps.read_text().splitlines():  # "start-end perms offset dev inode path"
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= ptr < hi:
            assert rest[-1] == str(path), line  # torch.load(mmap=True): pages read where used
            return
    pytest.fail("the tensor's memory is in no mapping")


def test_a_file_of_the_earlier_writer_still_reads(tmp_path):
    """Format 2 as first written: an unpadded header line, then the payload."""
    buf = io.BytesIO()
    torch.save({"engine": {"model": {"w": torch.arange(4.0)}}, "data": {}, "config": {"name": "t"}, "dtype": "fp32"}, buf)
    blob = buf.getvalue()
    header = {"format": 2, "run_id": "old", "step": 9, "time": 1.0, "bytes": len(blob), "crc32": zlib.crc32(blob)}
    path = tmp_path / "step-0000009.pt"
    path.write_bytes(b"XPUCKPT\n" + json.dumps(header).encode() + b"\n" + blob)
    got = read_checkpoint(path)
    assert got["step"] == 9 and torch.equal(got["engine"]["model"]["w"], torch.arange(4.0))


def test_a_flipped_byte_or_a_cut_file_is_refused_in_one_line(tmp_path):
    path = _save(tmp_path, {"model": {"w": torch.randn(1000)}})
    raw = bytearray(path.read_bytes())
    raw[-TRAILER - 100] ^= 0xFF  # in the payload
    path.write_bytes(bytes(raw))
    with pytest.raises(TrainConfigError, match="checksum mismatch"):
        read_checkpoint(path)
    path.write_bytes(bytes(raw[: len(raw) - 500]))  # the header, written last, is gone
    with pytest.raises(TrainConfigError, match="is truncated: its header, written last, is missing"):
        read_checkpoint(path)


def test_a_launchers_mark_spares_the_checksum_pass_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """`xpu mpress` verifies the file and hands its stages the mark; a changed file is verified again."""
    import os

    import strategies.training.checkpoints as ck

    path = _save(tmp_path, {"model": {"w": torch.randn(1000)}})
    passes = []
    real = ck.verify_streamed
    monkeypatch.setattr(ck, "verify_streamed", lambda *a: passes.append(a) or real(*a))
    mark = ck.verified_mark(path)
    assert torch.equal(read_checkpoint(path, mark)["engine"]["model"]["w"], read_checkpoint(path)["engine"]["model"]["w"])
    assert len(passes) == 1  # the read without the mark
    raw = bytearray(path.read_bytes())
    raw[-TRAILER - 100] ^= 0xFF
    path.write_bytes(bytes(raw))  # another mtime (and size kept): the mark no longer matches
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(TrainConfigError, match="checksum mismatch"):
        read_checkpoint(path, mark)
    assert len(passes) == 2


def test_a_memferry_checkpoint_saves_its_host_state_without_copying_it(cpu_backend, tmp_path):
    """``state_dict(copy=False)`` hands the host-homed masters and moments out as views, which
    the checkpoint writes once each (a file no larger than the copied state's), and a resume
    from it continues exactly."""
    from strategies.memferry import AdamW, MemFerry
    from strategies.models import build_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)

    def engine():
        torch.manual_seed(0)
        model = build_model("gpt", layers=2, hidden=32, heads=2, vocab=64, seq=16)
        return MemFerry(model, optim=AdamW(lr=1e-3), plan="prefetch", backend=cpu_backend)

    first = engine()
    first.train_step(x, y)
    unit = first.shadow.shadows[0]
    name = unit.unit.trainable[0][0]
    views, copies = first.state_dict(copy=False), first.state_dict()
    held = views["optimizer"][name]["exp_avg"].untyped_storage().data_ptr()
    assert held == unit.exp_avg.untyped_storage().data_ptr()  # the engine's own buffer
    assert copies["optimizer"][name]["exp_avg"].untyped_storage().data_ptr() != held
    data = SimpleNamespace(state_dict=lambda: {})
    path = save_checkpoint(tmp_path, 1, SimpleNamespace(state_dict=first.state_dict), data, {"name": "t"},
                           run_id="r", dtype_name="fp32")
    copied = io.BytesIO()
    torch.save({"engine": copies, "data": {}, "config": {"name": "t"}, "dtype": "fp32"}, copied)
    assert read_header(path)["bytes"] <= 1.02 * copied.tell()  # views saved their buffers once, no more
    straight = first.train_step(x, y).item()
    first.close()
    resumed = engine()
    resumed.load_state_dict(read_checkpoint(path)["engine"])
    assert resumed.train_step(x, y).item() == straight  # the step after the checkpoint, bit for bit
    resumed.close()
