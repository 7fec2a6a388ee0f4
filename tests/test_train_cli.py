"""`xpu train`: the README's first command end to end, config errors, checkpoint/resume, text data (cpu backend)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from strategies.training import (STRATEGIES, OptimizerConfig, TokenWindows, TrainConfigError, load_config, lr_at,
                                markov_corpus, read_checkpoint, train)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "train" / "gpt-tiny-memferry.yaml"

#: A model small enough that a step takes milliseconds.
MICRO = {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256}


def _xpu_train(*args: str, cwd: Path = ROOT, timeout: int = 120, flags: tuple = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *flags, "-m", "xpu", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _micro(**extra) -> dict:
    cfg = {"model": dict(MICRO), "steps": 6, "batch": 4, "seq": 16, "log_every": 1,
           "optimizer": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 2, "min_lr": 1e-4},
           "data": {"kind": "synthetic", "branching": 2}}
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------------------------- end to end
def test_readme_command_trains_and_the_loss_falls_importing_neither_transformers_nor_peft():
    """The README's first command, run as written. ``-X importtime`` also lists every module the
    run imports on stderr: a GPT run has no use for transformers or peft, and importing them costs
    a process seconds (session 52's LoRA code imported peft in every engine, about 3 s in each of
    the suite's many subprocesses). One process checks both: each start costs seconds."""
    proc = _xpu_train(str(TINY), "--steps", "30", "--set", "model.layers=2", "--no-progress", "--json",
                      flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "xpu.cli" in imported and "torch" in imported, proc.stderr[-2000:]  # the listing is there
    assert sorted(m for m in imported if m.split(".")[0] in ("transformers", "peft")) == []
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = result["losses"]
    assert len(losses) == 30 and result["steps"] == list(range(1, 31))
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # a fresh model guesses uniformly over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert result["peak_device_bytes"] > 0 and result["info"]["backend"] == "cpu" and result["info"]["dtype"] == "fp32"
    assert "step     30/30" in proc.stderr and "done: 30 steps" in proc.stderr


def test_bad_config_is_a_one_line_error_before_anything_runs(tmp_path):
    proc = _xpu_train(str(TINY), "--set", "strategy.name=nope", "--no-progress")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xpu train: error: unknown strategy 'nope'")
    assert all(name in lines[0] for name in STRATEGIES.names())
    assert proc.stdout == ""  # nothing was built or printed


def test_text_path_is_found_next_to_the_config_from_any_working_directory(tmp_path):
    (tmp_path / "corpus.txt").write_text("abcabcabc " * 40)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_micro(data={"kind": "text", "path": "corpus.txt"}, steps=3)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _xpu_train(str(tmp_path / "run.yaml"), "--no-progress", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "corpus.txt (400 bytes)" in proc.stdout and "done: 3 steps" in proc.stdout


# ---------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("change, message", [
    ({"stepz": 3}, "unknown key(s) ['stepz']; valid keys: model, name"),
    ({"strategy": "nope"}, "unknown strategy 'nope'; valid strategies: memferry, torch"),
    ({"strategy": {"name": "memferry", "options": {"plann": "dha"}}},
     "has no option(s) ['plann']; valid options: clip_fire_rate, compile_blocks, loss_chunks, max_grad_norm, "
     "memory_margin, plan, split_update"),
    ({"strategy": {"name": "memferry", "options": {"compile_blocks": "yes"}}},
     "compile_blocks must be true or false (blocks through torch.compile), got 'yes'"),
    ({"strategy": {"name": "memferry", "options": {"clip_fire_rate": 2}}}, "clip_fire_rate is the share of steps"),
    ({"strategy": {"name": "memferry", "options": {"split_update": "yes"}}}, "split_update must be true, false or null"),
    ({"strategy": {"name": "memferry", "options": {"clip_fire_rate": 0.3}}},
     "clip_fire_rate weighs steps whose clip fires, but max_grad_norm is not set"),
    ({"strategy": {"name": "memferry", "options": {"loss_chunks": 0}}}, "loss_chunks must be a positive integer"),
    ({"strategy": {"name": "memferry", "options": {"memory_margin": 1.5}}}, "memory_margin must lie in"),
    ({"strategy": {"name": "memferry", "options": {"plan": "resident9"}}}, "strategy.options.plan: unknown plan 'resident9'"),
    ({"strategy": {"name": "torch", "options": {"plan": "dha"}}}, "strategy 'torch' has no option(s) ['plan']"),
    ({"model": {**MICRO, "vocab": 100}, "data": {"kind": "text", "path": "x.txt"}}, "model's vocab is 100; set model.vocab to at least 256"),
    ({"data": {"kind": "text"}}, "data kind 'text' needs 'path'"),
    ({"data": {"kind": "text", "path": "/no/such/file.txt"}}, "no such file"),
    ({"data": {"kind": "csv"}}, "data.kind 'csv' is not valid; valid: synthetic, text"),
    ({"data": {"kind": "synthetic", "shuffle": True}}, "unknown data key(s) ['shuffle']; valid: kind, path, branching"),
    ({"dtype": "fp16"}, "dtype 'fp16' is not valid; valid: auto, fp32, bf16"),
    ({"optimizer": {"lr": 1e-3, "schedule": "linear"}}, "optimizer.schedule 'linear' is not valid; valid: constant, cosine"),
    ({"optimizer": {"momentum": 0.9}}, "unknown optimizer key(s) ['momentum']"),
    ({"device_budget": "lots"}, "device_budget: cannot read 'lots' as a byte size"),
    ({"checkpoint": {"every": 2}}, "checkpoint needs 'dir'"),
    ({"steps": 0}, "steps must be a positive integer, got 0"),
    ({"model": {**MICRO, "family": "bert"}}, "unknown model family 'bert'; valid families: gpt, hf, llama"),
    ({"model": {**MICRO, "seq": 8}}, "model.seq (8) is shorter than seq (16)"),
])
def test_bad_configs_name_what_is_valid(change, message):
    with pytest.raises(TrainConfigError) as info:
        load_config(_micro(**change))
    assert message in str(info.value)


def test_set_overrides_reach_nested_keys_and_bare_strategy_names():
    config = load_config(_micro(strategy="memferry"), {"strategy.options.plan": "prefetch2+recompute", "model.layers": 3})
    assert config.strategy.options == {"plan": "prefetch2+recompute", "max_grad_norm": None, "loss_chunks": "auto",
                                       "memory_margin": 0.10, "clip_fire_rate": 0.0, "split_update": None,
                                       "compile_blocks": False}
    assert config.model["layers"] == 3
    assert config.to_dict()["optimizer"]["betas"] == [0.9, 0.999]


def test_every_example_config_is_valid():
    for path in sorted((ROOT / "examples" / "train").glob("*.yaml")):
        load_config(path)


# ---------------------------------------------------------------------------------- checkpoint and resume
@pytest.mark.parametrize("strategy", ["memferry", "torch"])
def test_checkpoint_and_resume_continue_the_same_trajectory(cpu_backend, tmp_path, strategy):
    straight = train(load_config(_micro(strategy=strategy)), backend=cpu_backend)
    ckdir = tmp_path / "ck"
    first = train(load_config(_micro(strategy=strategy, steps=3, checkpoint={"every": 3, "dir": str(ckdir)})),
                  backend=cpu_backend)
    assert first.checkpoints == [str(ckdir / "step-0000003.pt")]
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-0000003.pt"]  # no temporary file left behind
    resumed = train(load_config(_micro(strategy=strategy, resume=str(ckdir))), backend=cpu_backend)
    assert resumed.steps == [4, 5, 6] and resumed.info.start_step == 3
    assert first.losses + resumed.losses == straight.losses  # exactly: same weights, moments, batches and lr
    assert straight.losses[-1] < straight.losses[0]


def test_bf16_memferry_keeps_fp32_masters_from_the_fp32_initial_weights(cpu_backend, tmp_path):
    """In bf16, MemFerry's masters start from the fp32 model the config seeds, not from its
    bf16 rounding, and its checkpoints hold fp32 weights."""
    from strategies.models import build_model

    ckdir = tmp_path / "ck"
    train(load_config(_micro(strategy={"name": "memferry", "options": {"plan": "prefetch"}}, dtype="bf16", steps=1,
                             optimizer={"lr": 1e-30}, checkpoint={"every": 1, "dir": str(ckdir)})), backend=cpu_backend)
    state = read_checkpoint(ckdir / "step-0000001.pt")["engine"]
    torch.manual_seed(0)
    init = build_model("gpt", seq=16, **{k: v for k, v in MICRO.items() if k != "family"})  # the config's seed, fp32
    for name, p in init.named_parameters():
        got = state["model"][name]
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, p.detach(), atol=1e-20, rtol=0, msg=name)  # lr 1e-30: still the fp32 start
    assert any(not torch.equal(p.detach().bfloat16().float(), p.detach()) for p in init.parameters())


def test_resume_refuses_a_checkpoint_of_another_model_or_one_already_done(cpu_backend, tmp_path):
    ckdir = tmp_path / "ck"
    train(load_config(_micro(steps=2, checkpoint={"every": 0, "dir": str(ckdir)})), backend=cpu_backend)
    assert [p.name for p in ckdir.iterdir()] == ["step-0000002.pt"]  # every: 0 still writes after the last step
    with pytest.raises(TrainConfigError, match="holds model .* the config asks for"):
        train(load_config(_micro(model={**MICRO, "layers": 3}, resume=str(ckdir))), backend=cpu_backend)
    with pytest.raises(TrainConfigError, match="written by strategy 'memferry'; the config uses 'torch'"):
        train(load_config(_micro(strategy="torch", resume=str(ckdir))), backend=cpu_backend)
    with pytest.raises(TrainConfigError, match="already reaches steps=2"):
        train(load_config(_micro(steps=2, resume=str(ckdir))), backend=cpu_backend)
    with pytest.raises(TrainConfigError, match="holds no step"):
        train(load_config(_micro(resume=str(tmp_path))), backend=cpu_backend)


def test_budget_is_enforced_checked_and_put_back(cpu_backend):
    total = cpu_backend.topology().devices[0].total_bytes
    with pytest.raises(TrainConfigError, match="exceeds device 0"):
        train(load_config(_micro(device_budget=total + 1)), backend=cpu_backend)
    result = train(load_config(_micro(steps=2, device_budget="64MB")), backend=cpu_backend)
    assert 0 < result.peak_device_bytes <= 64e6
    assert cpu_backend.memory_cap(0) is None  # the run's cap does not outlive it


# ---------------------------------------------------------------------------------- data and schedule
def test_text_windows_are_bytes_of_the_file_and_targets_shift_by_one(cpu_backend, tmp_path):
    text = "The ferry carried bread and apples across the harbour. " * 8
    (tmp_path / "t.txt").write_text(text)
    config = load_config(_micro(data={"kind": "text", "path": str(tmp_path / "t.txt")}, steps=4))
    corpus = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    windows = TokenWindows(corpus, batch=3, seq=16, seed=0)
    x, y = windows.next()
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in x:
        assert bytes(row.tolist()).decode() in text
    result = train(config, backend=cpu_backend)
    assert len(result.losses) == 4 and all(math.isfinite(v) for v in result.losses)


def test_synthetic_corpus_follows_its_successor_table():
    corpus = markov_corpus(vocab=50, branching=3, length=1 << 16, seed=0)
    counts = torch.zeros(50, 50)
    counts.index_put_((corpus[:-1], corpus[1:]), torch.ones(corpus.numel() - 1), accumulate=True)
    # every token's 3 successors carry nearly all its transitions (the rest: where two of the chains meet)
    top3 = counts.topk(3, dim=1).values.sum()
    assert top3 / counts.sum() > 0.99
    assert torch.equal(corpus, markov_corpus(vocab=50, branching=3, length=1 << 16, seed=0))


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    opt = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr=0.1)
    lrs = [lr_at(opt, i, 20) for i in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(opt, 20, 20) == pytest.approx(0.1)
    assert lr_at(OptimizerConfig(lr=0.5), 7, 20) == 0.5
