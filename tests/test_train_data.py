"""Real data for ``xpu train``: jsonl through a local tokenizer, pre-tokenized .npy/.bin, any iterable of batches,
the held-out split and its eval loss, and the one-line errors for bad data (cpu backend, fp32)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from strategies.training import StepReport, TrainCallback, TrainConfigError, load_config, train
from strategies.training.data import make_datasets

MICRO = {"family": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 256}
DOCS = ["the cat sat on the mat", "a dog ran in the park today", "the sun is warm and the sky is blue",
        "birds sing in the morning light", "rain fell on the quiet town"]
EOS = "<|endoftext|>"


def _config(**extra):
    cfg = {"model": dict(MICRO), "steps": 3, "batch": 2, "seq": 8, "log_every": 1, "dtype": "fp32", "strategy": "torch"}
    cfg.update(extra)
    return load_config(cfg)


def _tokenizer(tmp_path):
    """A WordLevel tokenizer trained here on DOCS, saved as tokenizer.json; and its encode."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]", EOS]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def _jsonl(tmp_path, docs=DOCS, field="text", repeat=4):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs * repeat)))
    return path


# ---------------------------------------------------------------------------------- jsonl
def test_jsonl_packs_documents_with_eos_between_them(tmp_path):
    tok_path, tok = _tokenizer(tmp_path)
    data = _jsonl(tmp_path)
    windows, evals, desc = make_datasets(_config(data={"kind": "jsonl", "path": str(data), "tokenizer": str(tok_path)}))
    eos = tok.token_to_id(EOS)
    expected = [i for d in DOCS * 4 for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    assert list(windows.corpus) == expected and evals == []
    assert "20 documents" in desc
    x, y = windows.next()
    rows = torch.cat([x, y[:, -1:]], 1).tolist()
    stream = "," + ",".join(map(str, expected)) + ","
    assert all("," + ",".join(map(str, r)) + "," in stream for r in rows)  # each window is a slice of the stream
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_jsonl_with_a_tokenizer_folder_trains(cpu_backend, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok_path, tok = _tokenizer(tmp_path)
    folder = tmp_path / "tok"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    data = _jsonl(tmp_path)
    config = _config(data={"kind": "jsonl", "path": str(data), "tokenizer": str(folder)})
    windows, _, _ = make_datasets(config)
    assert int(windows.corpus[-1]) == tok.token_to_id(EOS)
    result = train(config, backend=cpu_backend)
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))


# ---------------------------------------------------------------------------------- token files
@pytest.mark.parametrize("suffix, dtype", [(".npy", "uint16"), (".bin", "uint16"), (".bin", "uint32")])
def test_token_files_give_windows_of_the_file(cpu_backend, tmp_path, suffix, dtype):
    ids = np.random.default_rng(0).integers(0, 256, 500).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    config = _config(data={"kind": "tokens", "path": str(path), "dtype": dtype})
    windows, _, desc = make_datasets(config)
    assert "500 tokens" in desc and isinstance(windows.corpus, np.ndarray)
    x, y = windows.next()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        row = row_x + row_y[-1:]
        starts = [s for s in range(500 - 8) if ids[s:s + 9].tolist() == row]
        assert starts, "a window is not a slice of the file"
    assert train(config, backend=cpu_backend).steps == [1, 2, 3]


# ---------------------------------------------------------------------------------- bad data
def _bad_cases(tmp_path):
    tok_path, _ = _tokenizer(tmp_path)
    data = _jsonl(tmp_path)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(5, dtype=np.uint16))
    big = tmp_path / "big.npy"
    np.save(big, np.full(100, 300, dtype=np.uint16))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 21)
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"text": "the cat"}) + "\n")
    return [
        ({"kind": "jsonl", "path": str(tmp_path / "nope.jsonl"), "tokenizer": str(tok_path)}, "no such file"),
        ({"kind": "jsonl", "path": str(data), "field": "body", "tokenizer": str(tok_path)}, "line 1 has no field 'body'"),
        ({"kind": "jsonl", "path": str(data)}, "needs 'tokenizer'"),
        ({"kind": "jsonl", "path": str(data), "tokenizer": str(tmp_path / "missing")}, "no such folder or file"),
        ({"kind": "jsonl", "path": str(few), "tokenizer": str(tok_path)}, "gives 3 tokens; a window of seq + 1 = 9"),
        ({"kind": "tokens", "path": str(short)}, "holds 5 tokens; a window of seq + 1 = 9"),
        ({"kind": "tokens", "path": str(big)}, "holds token id 300 but the model's vocab is 256"),
        ({"kind": "tokens", "path": str(odd), "dtype": "uint16"}, "not a whole number of uint16 tokens"),
        ({"kind": "tokens", "path": str(odd), "dtype": "int8"}, "data.dtype 'int8' is not valid"),
        ({"kind": "tokens", "path": str(big), "eval_fraction": 1.5}, "eval_fraction must lie in [0, 1)"),
    ]


def test_bad_data_is_a_one_line_error_before_the_model_is_built(cpu_backend, tmp_path, monkeypatch):
    import strategies.models

    def no_build(*a, **k):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(strategies.models, "build_model", no_build)
    for data, message in _bad_cases(tmp_path):
        with pytest.raises(TrainConfigError) as info:
            train(_config(data=data), backend=cpu_backend)
        text = str(info.value)
        assert message in text and "\n" not in text, (data, text)


def test_a_tokenizer_without_eos_asks_for_eos_id(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "t.json"))
    data = {"kind": "jsonl", "path": str(_jsonl(tmp_path)), "tokenizer": str(tmp_path / "t.json")}
    with pytest.raises(TrainConfigError, match="names no EOS token .*; set data.eos_id"):
        make_datasets(_config(data=data))
    windows, _, _ = make_datasets(_config(data={**data, "eos_id": 0}))
    assert int(windows.corpus[-1]) == 0


def test_eval_every_needs_a_held_out_share():
    with pytest.raises(TrainConfigError, match="eval_every needs held-out data: set data.eval_fraction"):
        _config(eval_every=2)


# ---------------------------------------------------------------------------------- held-out eval
class _Reports(TrainCallback):
    def __init__(self):
        self.reports: list[StepReport] = []

    def on_step(self, report):
        self.reports.append(report)


def test_eval_loss_every_k_steps_on_fixed_held_out_windows(cpu_backend, tmp_path):
    path = tmp_path / "pos.npy"
    np.save(path, np.arange(256, dtype=np.uint16))  # token = its position: a window shows where it came from
    config = _config(steps=5, eval_every=2, eval_batches=3, data={"kind": "tokens", "path": str(path), "eval_fraction": 0.25})
    windows, evals, desc = make_datasets(config)
    assert "last 64 tokens held out" in desc and len(evals) == 3
    for _ in range(200):  # training windows never reach the held-out quarter
        x, y = windows.next()
        assert int(y.max()) < 192
    assert all(int(x.min()) >= 192 for x, _ in evals)
    again = make_datasets(config)[1]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(evals, again))
    reports = _Reports()
    result = train(config, reports, backend=cpu_backend)
    assert [s for s, _ in result.eval_losses] == [2, 4, 5]
    assert [r.step for r in reports.reports if r.eval_loss is not None] == [2, 4, 5]
    assert [r.eval_loss for r in reports.reports if r.eval_loss is not None] == [v for _, v in result.eval_losses]
    assert all(np.isfinite(v) for _, v in result.eval_losses)


def test_memferry_eval_loss_matches_torch(cpu_backend, tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.random.default_rng(1).integers(0, 256, 400).astype(np.uint16))
    data = {"kind": "tokens", "path": str(path), "eval_fraction": 0.2}
    a = train(_config(steps=2, eval_every=1, data=data), backend=cpu_backend)
    b = train(_config(steps=2, eval_every=1, data=data, strategy="memferry"), backend=cpu_backend)
    assert [s for s, _ in b.eval_losses] == [1, 2]
    assert [v for _, v in b.eval_losses] == pytest.approx([v for _, v in a.eval_losses], abs=1e-5)


# ---------------------------------------------------------------------------------- any iterable
def test_an_iterable_of_batches_trains_like_the_same_batches_from_the_config(cpu_backend):
    config = _config(data={"kind": "synthetic", "branching": 2})
    windows, _, _ = make_datasets(config)
    batches = [windows.next() for _ in range(3)]
    own = train(config, backend=cpu_backend)
    given = train(_config(data={"kind": "synthetic", "branching": 2}), data=batches, backend=cpu_backend)
    assert given.losses == own.losses
    assert given.info.data.startswith("batches from the caller's iterable")
    with pytest.raises(ValueError, match="the data iterable ran out after 2 batches"):
        train(_config(), data=batches[:2], backend=cpu_backend)


def test_resume_with_an_iterable_says_its_position_is_lost(cpu_backend, tmp_path):
    batches = [{"input_ids": torch.randint(0, 256, (2, 9))} for _ in range(5)]
    ck = tmp_path / "ck"
    train(_config(steps=2, checkpoint={"every": 2, "dir": str(ck)}), data=batches, backend=cpu_backend)

    class Notes(TrainCallback):
        notes: list[str] = []

        def on_notice(self, message):
            self.notes.append(message)

    notes = Notes()
    result = train(_config(steps=3, resume=str(ck)), notes, data=batches, backend=cpu_backend)
    assert result.steps == [3]
    assert any("data iterable cannot be restored to its position" in n for n in notes.notes)


def test_a_checkpoint_from_before_the_new_keys_still_resumes(tmp_path):
    """A saved config without accumulation_steps or the new data keys means their defaults."""
    from pathlib import Path

    from strategies.training.checkpoints import compare_configs

    config = _config(data={"kind": "synthetic", "branching": 2})
    old = config.to_dict()
    old.pop("accumulation_steps")
    old["data"] = {"kind": "synthetic", "path": None, "branching": 2}
    assert compare_configs(old, "fp32", config, "fp32", Path("step-1.pt")) == []
    changed = _config(data={"kind": "synthetic", "branching": 2, "eval_fraction": 0.1})
    with pytest.raises(TrainConfigError, match=r"eval_fraction.: 0.1}; changing the data"):
        compare_configs(old, "fp32", changed, "fp32", Path("step-1.pt"))


def test_cli_prints_the_eval_loss(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent
    np.save(tmp_path / "t.npy", np.random.default_rng(2).integers(0, 256, 600).astype(np.uint16))
    cfg = {"model": MICRO, "strategy": "torch", "steps": 2, "batch": 2, "seq": 8, "log_every": 5, "eval_every": 2,
           "data": {"kind": "tokens", "path": "t.npy", "eval_fraction": 0.2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, XPU_BACKEND="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "xpu", "train", str(tmp_path / "c.yaml"), "--no-progress"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "step      2/2" in out and " eval " in out.split("step      2/2")[1].splitlines()[0]
    assert "; eval loss " in out
