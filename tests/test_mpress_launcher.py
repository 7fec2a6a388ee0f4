"""`xpu mpress`: config checks before any process starts, the torchrun command, a real 2-stage torchrun run
whose losses equal the unpipelined run of the same config (cpu backend, gloo), and checkpoints resumed under
another pipeline."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import xpu
from strategies.mpress.launcher import MPressConfigError, launch_command, load_config, reference_losses, under_torchrun
from xpu.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "mpress" / "tiny.yaml"

#: A GPT small enough that process start-up, not training, is the cost.
MICRO = {
    "name": "micro",
    "model": {"family": "gpt", "layers": 4, "hidden": 32, "heads": 2, "vocab": 64},
    # Every decision kind in one run: host swap and recompute on stage 0, a D2D swap into stage 0's device.
    "strategy": {"name": "mpress", "options": {"stages": 2, "microbatches": 4, "schedule": "1f1b",
                                               "plan": {0: {0: "host", 1: "recompute"}, 1: {2: "peer:0"}}}},
    "optimizer": {"lr": 1.0e-2, "schedule": "cosine", "warmup_steps": 1, "min_lr": 1.0e-3},
    "steps": 2, "batch": 8, "seq": 16, "log_every": 1,
    "data": {"kind": "synthetic", "branching": 4},
}


@pytest.fixture
def no_launch(monkeypatch):
    """Not under torchrun, and any attempt to start a process fails the test."""
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(os, "execv", refuse)
    monkeypatch.setenv("XPU_BACKEND", "cpu")
    xpu.reset_backend()
    yield
    xpu.reset_backend()


def _config(tmp_path: Path, **changes) -> Path:
    cfg = yaml.safe_load(yaml.safe_dump(MICRO))
    cfg.update(changes)
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------------------------- checks before anything starts
@pytest.mark.parametrize("args, message", [
    (["--stages", "5"], "stages (--stages) is 5 but model.layers is 4: each stage needs at least one block; use at most 4"),
    (["--microbatches", "3"], "microbatches (--microbatches) is 3, which does not divide batch 8 into equal "
                              "micro-batches; use one of 1, 2, 4, 8"),
    (["--stages", "4", "--microbatches", "2"], "schedule 1f1b needs at least as many micro-batches as stages"),
    (["--schedule", "zb"], "strategy.options.schedule (--schedule) is 'zb'; valid: gpipe, 1f1b"),
    (["--nproc", "3", "--stages", "2"], "--nproc 3 and --stages 2 differ"),
    (["--budget-gb", "0"], "--budget-gb must be a positive number of GB"),
    (["--budget-gb", "100"], "device_budget (--budget-gb) 100.0 GB exceeds device 0's 2.0 GB"),
    (["--set", "strategy.options.plann=keep"], "strategy 'mpress' has no option(s) ['plann']; valid options: counts, "
                                                "devices, microbatches, plan, profile, schedule, stages"),
    (["--set", "strategy.options.devices=[0]"], "strategy.options.devices lists 1 device(s) for 2 stages; give one "
                                                "device index per stage, e.g. [0, 0] (every stage on device 0) or [0, 1]"),
    (["--set", "strategy.options.devices=[0, -1]"], "strategy.options.devices[1] is -1; device indices are whole "
                                                    "numbers from 0, e.g. [0, 0]"),
    (["--set", "strategy.options.devices=0"], "strategy.options.devices must list one device index per stage (e.g. "
                                              "[0, 0] (every stage on device 0) or [0, 1]), or be null for stage i"),
    (["--set", "strategy.options.devices=[0, 99]"], "strategy.options.devices[1] = 99 is out of range: backend 'cpu' has "),
    (["--set", "strategy.name=memferry"], "xpu mpress runs only 'mpress' (use `xpu train` for memferry or torch)"),
    (["--set", "stepz=3"], "unknown key(s) ['stepz']; valid keys: model, name, description, strategy, device_budget"),
    (["--set", "strategy.options.plan={0: {3: host}}"], "block 3 is not on stage 0, which runs blocks 0..1"),
    (["--set", "strategy.options.plan={1: {2: swap}}"], "stage 1 block 2: unknown decision 'swap'"),
    (["--set", "strategy.options.plan={1: {2: 'peer:1'}}"], "peer 1 must be another stage's device"),
    (["--set", "strategy.options.counts=[3, 2]"], "strategy.options.counts: block counts [3, 2] must be 2 positive"),
    (["--set", "model.family=hf", "--set", "model.config={model_type: gpt2}"], "model.family 'hf' cannot be split"),
    (["--resume", "no/such/run"], "resume: no checkpoint file or folder 'no/such/run'"),
    (["--set", "logging.csv=."], "logging.csv '.' is a folder; give a file"),
    (["--set", "accumulation_steps=2"], "'accumulation_steps' is not an xpu mpress key: the pipeline splits each batch "
                                        "into strategy.options.microbatches (--microbatches) micro-batches"),
    (["--set", "eval_every=2", "--set", "data.eval_fraction=0.1"], "'eval_every' is not supported by xpu mpress"),
    (["--set", "optimizer.lr=-1"], "optimizer.lr must be a positive number"),
])
def test_bad_config_is_a_one_line_error_before_any_process_starts(tmp_path, capsys, no_launch, args, message):
    rc = main(["mpress", str(_config(tmp_path)), *args])
    out, err = capsys.readouterr()
    lines = [l for l in err.strip().splitlines() if not l.startswith("xpu: no npu or cuda")]
    assert rc == 2 and out == "", (out, err)
    assert len(lines) == 1 and lines[0].startswith("xpu mpress: error: "), err
    assert message in lines[0], lines[0]


def test_config_errors_name_the_key_from_python():
    with pytest.raises(MPressConfigError, match="no config file"):
        load_config("no/such/file.yaml")
    with pytest.raises(MPressConfigError, match="dimension"):
        load_config({**MICRO, "model": {"family": "gpt", "layers": 2}})
    assert load_config({**MICRO, "accumulation_steps": 1, "eval_every": 0}).train.accumulation_steps == 1  # inert values pass
    config = load_config(TINY)
    assert (config.stages, config.microbatches, config.schedule, config.plan, config.profile) == (2, 4, "1f1b", "auto", "auto")
    assert config.train.family == "gpt" and config.train.data_path().is_file()


def test_dry_run_prints_the_torchrun_command_and_starts_nothing(tmp_path, capsys, monkeypatch, no_launch):
    monkeypatch.setenv("XPU_CPU_DEVICES", "1")  # fewer virtual devices than stages: the ranks are given enough
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    xpu.reset_backend()
    cfg = str(_config(tmp_path))
    assert main(["mpress", cfg, "--nproc", "4", "--schedule", "gpipe", "--budget-gb", "0.5",
                 "--set", "strategy.options.plan=keep", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"OMP_NUM_THREADS=1 XPU_CPU_DEVICES=4 {sys.executable} -m torch.distributed.run --standalone "
                    f"--nproc_per_node 4 -m xpu mpress {cfg} --stages 4 --schedule gpipe --budget-gb 0.5 "
                    f"--set strategy.options.plan=keep"), line
    assert launch_command("c.yaml", 2, ["--json"])[-4:] == ["c.yaml", "--stages", "2", "--json"]
    # A devices map names its devices: none are made up, and device 0 exists.
    assert main(["mpress", cfg, "--set", "strategy.options.devices=[0, 0]", "--dry-run"]) == 0
    assert "XPU_CPU_DEVICES" not in capsys.readouterr().out
    assert under_torchrun({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}) and not under_torchrun({"WORLD_SIZE": "2"})


def test_example_config_dry_run():
    """The example config from the command line, with a learning rate in exponent form (a float, so
    the config check passes it: issue 17's bad input)."""
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(ROOT))
    for key in ("LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "xpu", "mpress", str(TINY), "--set", "optimizer.lr=3E-4", "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m torch.distributed.run --standalone --nproc_per_node 2 -m xpu mpress" in proc.stdout
    assert "--set optimizer.lr=3E-4" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------- end to end through torchrun
def _mpress(cfg: Path, *args: str, backend: str = "cpu") -> dict:
    env = dict(os.environ, XPU_BACKEND=backend, PYTHONPATH=str(ROOT), XPU_COLLECTIVE_TIMEOUT_S="60")
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "xpu", "mpress", str(cfg), "--json", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "log": proc.stderr}


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """One 2-stage torchrun run of MICRO for 4 steps, checkpointed at steps 2 and 4 with a CSV log:
    compared with the unpipelined run, then resumed under another pipeline (a run costs ~10 s)."""
    tmp = tmp_path_factory.mktemp("two-stages")
    cfg = _config(tmp, steps=4, checkpoint={"dir": str(tmp / "run"), "every": 2}, logging={"csv": str(tmp / "log.csv")})
    return tmp, cfg, _mpress(cfg)


def test_two_stages_through_torchrun_match_the_unpipelined_run(two_stages, tmp_path, cpu_backend):
    _, _, summary = two_stages
    log = summary["log"]
    # Rank 0 printed the plan and a line per step (on stderr with --json, so stdout is the summary alone).
    assert "-m torch.distributed.run --standalone --nproc_per_node 2" in log
    assert "plan (given; unlisted blocks kept):\nstage 0: block 0: host, block 1: recompute\nstage 1: block 2: peer:0" \
        in log, log
    assert all(f"step      {i}/4  loss" in log for i in range(1, 5)), log
    assert summary["stages"] == 2 and len(summary["peaks"]) == 2 and all(p > 0 for p in summary["peaks"])
    assert summary["decisions"] == {"0": {"0": "host", "1": "recompute"}, "1": {"2": "peer:0"}}

    # The same config without the run's checkpoint folder and CSV log (the reference would refuse
    # the filled folder, and append to the log).
    ref = reference_losses(load_config(_config(tmp_path, steps=4)), backend=cpu_backend)
    assert len(summary["losses"]) == len(ref) == 4
    for step, (got, want) in enumerate(zip(summary["losses"], ref)):
        assert abs(got - want) < 1e-6, (step, got, want)
    assert ref[1] != ref[0]  # the second step saw an AdamW update: the optimizers agree, not just the forward


# ---------------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_resumes_under_another_pipeline_with_the_uninterrupted_losses(two_stages):
    """Two stages write step 2 and 4; three stages under GPipe resume step 2 and train steps 3-4 as the
    uninterrupted run did, and write the same weights and AdamW state, named as the unpipelined model's;
    the ``logging.csv`` rows go on from the resumed step."""
    from strategies.models import build_model
    from strategies.training import read_checkpoint
    from strategies.training.checkpoints import VERIFIED_ENV, verified_mark

    tmp_path, cfg, full = two_stages
    csv_log = tmp_path / "log.csv"
    assert [Path(p).name for p in full["checkpoints"]] == ["step-0000002.pt", "step-0000004.pt"]
    want = read_checkpoint(tmp_path / "run" / "step-0000004.pt")
    names = set(build_model("gpt", **{k: v for k, v in MICRO["model"].items() if k != "family"}).state_dict())
    assert set(want["engine"]["model"]) == names and set(want["engine"]["optimizer"]) == names
    assert want["config"]["strategy"]["name"] == "mpress"

    resumed = _mpress(cfg, "--resume", str(tmp_path / "run" / "step-0000002.pt"), "--stages", "3",
                      "--schedule", "gpipe", "--set", "strategy.options.plan=auto")
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 2
    # The launcher verified the file and hands the stages its mark: they skip the checksum pass.
    mark = verified_mark(tmp_path / "run" / "step-0000002.pt")
    assert f"{VERIFIED_ENV}={shlex.quote(mark)}" in resumed["log"], resumed["log"][-2000:]
    # The CSV log keeps steps 1-2 and takes 3-4 from the resumed run (the first run's 3-4 dropped).
    rows = [line.split(",") for line in csv_log.read_text().splitlines()]
    assert rows[0][:3] == ["step", "loss", "lr"] and [int(r[0]) for r in rows[1:]] == [1, 2, 3, 4]
    assert [float(r[1]) for r in rows[3:]] == pytest.approx(resumed["losses"], abs=1e-6)
    assert [float(r[1]) for r in rows[1:3]] == pytest.approx(full["losses"][:2], abs=1e-6)
    assert "resume: changed since step-0000002.pt: strategy.options.stages: 2 -> 3; strategy.options.schedule: " \
           "1f1b -> gpipe" in resumed["log"]
    for got, ref in zip(resumed["losses"], full["losses"][2:]):
        assert abs(got - ref) < 1e-6, (resumed["losses"], full["losses"])
    got = read_checkpoint(tmp_path / "run" / "step-0000004.pt")  # the resumed run's, same run id: replaced
    assert got["run_id"] == want["run_id"] and got["time"] > want["time"]
    for name, t in want["engine"]["model"].items():
        torch.testing.assert_close(got["engine"]["model"][name], t, rtol=1e-5, atol=1e-6)
        for key, m in want["engine"]["optimizer"][name].items():
            torch.testing.assert_close(got["engine"]["optimizer"][name][key], m, rtol=1e-5, atol=1e-7)


def test_checkpoint_misuse_is_a_one_line_error_before_any_process_starts(tmp_path, capsys, no_launch):
    from strategies.training import load_config as train_config, train

    run = tmp_path / "run"
    other = tmp_path / "other"
    train(train_config({**{k: v for k, v in MICRO.items() if k not in ("strategy", "name")}, "strategy": "torch",
                        "steps": 1, "checkpoint": {"dir": str(other)}}))
    (run).mkdir()
    (run / "step-0000001.pt").write_bytes((other / "step-0000001.pt").read_bytes())
    cases = [
        (["--resume", str(other)], "was written by xpu train (strategy 'torch'); xpu mpress resumes only its own"),
        (["--set", f"checkpoint.dir={run}"], f"checkpoint.dir '{run}' already holds 1 checkpoints (step-0000001.pt, "
                                             f"...); pass `--resume {run}` to continue it, `--overwrite`"),
    ]
    for args, message in cases:
        rc = main(["mpress", str(_config(tmp_path)), *args])
        out, err = capsys.readouterr()
        lines = [l for l in err.strip().splitlines() if not l.startswith("xpu: no npu or cuda")]
        assert rc == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.gpu
def test_a_checkpoint_of_two_stages_on_one_gpu_resumes_with_the_uninterrupted_losses(tmp_path, gpu_backend):
    """On the device: both stages on device 0 (gloo between them), a checkpoint at step 2, resumed to step 4."""
    cfg = _config(tmp_path, steps=4, checkpoint={"dir": str(tmp_path / "run"), "every": 2})
    devices = ["--set", "strategy.options.devices=[0, 0]", "--set", "dtype=fp32"]
    full = _mpress(cfg, *devices, backend=gpu_backend.name)
    resumed = _mpress(cfg, *devices, "--resume", str(tmp_path / "run" / "step-0000002.pt"), backend=gpu_backend.name)
    assert resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-4)
