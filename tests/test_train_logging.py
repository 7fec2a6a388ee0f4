"""The ``logging:`` key: CSV rows equal to the run's result (and appended on resume), TensorBoard and W&B
writers (fakes injected in sys.modules; the real TensorBoard when installed), rank 0 only, config errors."""
from __future__ import annotations

import csv
import sys
import types
from pathlib import Path

import pytest
import torch

from strategies.training import CallbackList, TrainCallback, TrainConfigError, load_config, train
from strategies.training.log_sinks import COLUMNS, make_sinks

MICRO = {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64}


def _cfg(**extra) -> dict:
    cfg = {"model": dict(MICRO), "strategy": "torch", "steps": 3, "batch": 2, "seq": 16, "log_every": 1,
           "optimizer": {"lr": 3e-3}, "data": {"kind": "synthetic", "branching": 2, "eval_fraction": 0.25},
           "eval_every": 2, "eval_batches": 1}
    cfg.update(extra)
    return cfg


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _check_rows(rows: list[list[str]], results: list) -> None:
    """Rows (header dropped) hold exactly what the results say, step by step."""
    steps = [s for r in results for s in r.steps]
    assert [int(r[0]) for r in rows] == steps
    assert [float(r[1]) for r in rows] == [v for r in results for v in r.losses]  # repr round-trips: equal
    assert [float(r[2]) for r in rows] == [v for r in results for v in r.lrs]
    assert [float(r[3]) for r in rows] == [v for r in results for v in r.step_times_s]
    tokens = results[0].info.tokens_per_step
    assert [float(r[4]) for r in rows] == pytest.approx([tokens / t for r in results for t in r.step_times_s], rel=1e-12)
    assert all(int(r[5]) >= 0 for r in rows)
    evals = dict(e for r in results for e in r.eval_losses)
    assert {int(r[0]): float(r[6]) for r in rows if r[6]} == evals


# ---------------------------------------------------------------------------------- CSV
def test_csv_rows_equal_the_results_values(cpu_backend, tmp_path):
    path = tmp_path / "logs" / "run.csv"  # the folder is made
    result = train(load_config(_cfg(logging={"csv": str(path)})), backend=cpu_backend)
    rows = _rows(path)
    assert tuple(rows[0]) == COLUMNS == ("step", "loss", "lr", "step_s", "tokens_per_s", "peak_device_bytes", "eval_loss")
    assert result.steps == [1, 2, 3] and [s for s, _ in result.eval_losses] == [2, 3]
    _check_rows(rows[1:], [result])
    assert rows[1][6] == ""  # no evaluation at step 1


def test_resume_appends_without_a_second_header_and_drops_the_killed_runs_extra_rows(cpu_backend, tmp_path):
    path, ck = tmp_path / "run.csv", tmp_path / "ck"
    first = train(load_config(_cfg(logging={"csv": str(path)}, checkpoint={"dir": str(ck), "every": 3})),
                  backend=cpu_backend)
    with open(path, "a", newline="") as f:  # a run killed after step 4, before its next checkpoint
        f.write("4,9.0,0.001,0.5,100.0,0,\n")
    resumed = train(load_config(_cfg(steps=5, resume=str(ck), logging={"csv": str(path)},
                                     checkpoint={"dir": str(ck), "every": 3})), backend=cpu_backend)
    assert resumed.steps == [4, 5]
    rows = _rows(path)
    assert tuple(rows[0]) == COLUMNS and sum(tuple(r) == COLUMNS for r in rows) == 1
    _check_rows(rows[1:], [first, resumed])  # the stale step-4 row is gone: step 4 appears once, with its real loss


def test_a_fresh_run_starts_the_file_over_and_a_failed_run_keeps_its_rows(cpu_backend, tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("old,contents\n")

    class Stop(TrainCallback):
        def on_step(self, report):
            if report.step == 2:
                raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        train(load_config(_cfg(logging={"csv": str(path)})), Stop(), backend=cpu_backend)
    rows = _rows(path)  # closed by on_end: readable, the first step's row there
    assert tuple(rows[0]) == COLUMNS and [r[0] for r in rows[1:]] == ["1"]


def test_resume_into_a_csv_of_other_columns_is_refused(cpu_backend, tmp_path):
    path, ck = tmp_path / "run.csv", tmp_path / "ck"
    train(load_config(_cfg(checkpoint={"dir": str(ck), "every": 3})), backend=cpu_backend)
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TrainConfigError, match=r"logging.csv .* has columns \['a', 'b'\], not \['step', 'loss'"):
        train(load_config(_cfg(steps=4, resume=str(ck), logging={"csv": str(path)}, checkpoint={"dir": str(ck)})),
              backend=cpu_backend)
    assert path.read_text() == "a,b\n1,2\n"


# ---------------------------------------------------------------------------------- TensorBoard
class _FakeWriter:
    made: list["_FakeWriter"] = []

    def __init__(self, log_dir=None, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.flushes, self.closed = log_dir, purge_step, [], 0, False
        _FakeWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """``tensorboard`` and ``torch.utils.tensorboard.SummaryWriter`` stand-ins recording the writer's calls."""
    _FakeWriter.made = []
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    return _FakeWriter


def test_tensorboard_writer_gets_each_steps_scalars(cpu_backend, tmp_path, fake_tensorboard):
    ck = tmp_path / "ck"
    tb = tmp_path / "tb"
    first = train(load_config(_cfg(logging={"tensorboard": str(tb)}, checkpoint={"dir": str(ck), "every": 3})),
                  backend=cpu_backend)
    (w,) = fake_tensorboard.made
    assert w.log_dir == str(tb) and w.purge_step is None and w.closed and w.flushes == 3
    assert [(s, v) for t, v, s in w.scalars if t == "train/loss"] == list(zip(first.steps, first.losses))
    assert [(s, v) for t, v, s in w.scalars if t == "train/lr"] == list(zip(first.steps, first.lrs))
    assert [(s, v) for t, v, s in w.scalars if t == "eval/loss"] == first.eval_losses
    assert {t for t, _, _ in w.scalars} == {"train/loss", "train/lr", "train/step_s", "train/tokens_per_s",
                                             "train/peak_device_bytes", "eval/loss"}
    train(load_config(_cfg(steps=4, resume=str(ck), logging={"tensorboard": str(tb)}, checkpoint={"dir": str(ck)})),
          backend=cpu_backend)
    assert fake_tensorboard.made[1].purge_step == 4  # events of re-run steps (>= 4) from a killed run are dropped


def test_real_tensorboard_event_file_reads_back_the_losses(cpu_backend, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(load_config(_cfg(logging={"tensorboard": str(tmp_path / "tb")})), backend=cpu_backend)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == result.steps
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)  # stored as float32
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == pytest.approx(result.eval_losses, rel=1e-6)


# ---------------------------------------------------------------------------------- W&B
@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` stand-in: ``init`` returns a run recording ``log`` and ``finish`` (nothing leaves the machine)."""
    calls: dict = {"init": [], "log": [], "finish": []}
    run = types.SimpleNamespace(log=lambda values, step: calls["log"].append((step, values)),
                                finish=lambda exit_code=None: calls["finish"].append(exit_code))
    module = types.ModuleType("wandb")
    module.init = lambda **kw: calls["init"].append(kw) or run
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_run_gets_the_config_and_each_steps_values(cpu_backend, fake_wandb):
    result = train(load_config(_cfg(name="tiny", logging={"wandb": {"project": "xpu", "mode": "offline"}})),
                   backend=cpu_backend)
    (init,) = fake_wandb["init"]
    assert (init["project"], init["name"], init["mode"], init["entity"]) == ("xpu", "tiny", "offline", None)
    assert init["id"] == result.info.run_id and init["resume"] == "allow" and init["config"]["steps"] == 3
    assert [(s, v["train/loss"]) for s, v in fake_wandb["log"]] == list(zip(result.steps, result.losses))
    assert [(s, v["eval/loss"]) for s, v in fake_wandb["log"] if "eval/loss" in v] == result.eval_losses
    assert fake_wandb["finish"] == [0]


# ---------------------------------------------------------------------------------- fan-out, ranks, errors
def test_callback_list_ends_every_callback_and_notices_reach_the_display_once(cpu_backend, tmp_path, caplog):
    ended = []

    class End(TrainCallback):
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def on_end(self, result):
            ended.append(self.name)
            if self.fail:
                raise OSError(self.name)

    with pytest.raises(OSError, match="^a$"):
        CallbackList([End("a", fail=True), End("b")]).on_end(None)
    assert ended == ["a", "b"]
    sinks = make_sinks(load_config(_cfg(logging={"csv": str(tmp_path / "x.csv")})))
    with caplog.at_level("WARNING", logger="strategies.training"):
        CallbackList([TrainCallback(), *sinks]).on_notice("resume: lr changed")
    assert [r.message for r in caplog.records] == ["resume: lr changed"]


def test_only_rank_zero_logs(monkeypatch, tmp_path):
    config = load_config(_cfg(logging={"csv": str(tmp_path / "x.csv")}))
    assert len(make_sinks(config)) == 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert make_sinks(config) == []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    assert len(make_sinks(config)) == 1


@pytest.mark.parametrize("logging, message", [
    ({"csvv": "x.csv"}, "unknown logging key(s) ['csvv']; valid: csv, tensorboard, wandb"),
    ({"csv": 3}, "logging.csv must be a path, got 3"),
    ({"csv": "."}, "logging.csv '.' is a folder; give a file"),
    ({"wandb": {"name": "x"}}, "logging.wandb needs 'project'"),
    ({"wandb": {"project": "p", "team": "t"}}, "unknown logging.wandb key(s) ['team']; valid: project, name, entity, mode"),
    ({"wandb": {"project": "p", "mode": "cloud"}}, "logging.wandb.mode 'cloud' is not valid; valid: online, offline"),
    ({"wandb": "p"}, "logging.wandb must be a mapping"),
])
def test_bad_logging_values_are_one_line_errors(fake_wandb, logging, message):
    with pytest.raises(TrainConfigError) as info:
        load_config(_cfg(logging=logging))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("key, value, package", [("tensorboard", "tb", "tensorboard"),
                                                 ("wandb", {"project": "p"}, "wandb")])
def test_a_missing_package_is_named_with_its_pip_install_before_the_run(monkeypatch, key, value, package):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(TrainConfigError, match=f"logging.{key} needs the {package} package: pip install {package}"):
        load_config(_cfg(logging={key: value}))


def test_xpu_train_says_where_it_logs_and_writes_the_rows(tmp_path, capsys, monkeypatch):
    import yaml

    import xpu
    from xpu.cli import main

    monkeypatch.setenv("XPU_BACKEND", "cpu")
    xpu.reset_backend()
    path = tmp_path / "run.csv"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_cfg(logging={"csv": str(path)})))
    try:
        assert main(["train", str(tmp_path / "run.yaml"), "--no-progress"]) == 0
    finally:
        xpu.reset_backend()
    assert f"logging to csv {path}" in capsys.readouterr().out
    assert [r[0] for r in _rows(path)] == ["step", "1", "2", "3"]
