"""``data.packing: false``: one whole jsonl record per row (cut at ``seq + 1`` tokens, right-padded,
its padding never a target) instead of windows drawn across records."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.training import TrainConfigError, load_config, train  # noqa: E402
from strategies.training.data import RecordRows, make_datasets  # noqa: E402
from tests.test_chat_data import _config, _tokenizer_folder, _write  # noqa: E402
from tests.test_hf_finetune import plain_adamw_losses  # noqa: E402


def _short_conversations(n=40):
    """One exchange each, 26 to 59 tokens: some longer than a row of ``seq + 1`` = 41 tokens, some shorter."""
    return [[{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}." + " Yes." * (i % 7)}]
            for i in range(n)]


def _chat_config(tmp_path, **data):
    tmp_path.mkdir(exist_ok=True)
    folder, tok = _tokenizer_folder(tmp_path)
    run = _config(tmp_path, _write(tmp_path, _short_conversations()), folder, len(tok), packing=False, **data)
    return load_config({**run, "seq": 40})


def _expected_rows(corpus, starts, trained, seq, pad):
    """Every record as the row it must become: (inputs, targets) lists."""
    rows = []
    for lo, hi in zip(starts[:-1], starts[1:]):
        hi = min(hi, lo + seq + 1)
        ids = [int(t) for t in corpus[lo:hi]]
        n = len(ids) - 1
        targets = [t if trained[lo + 1 + k] else -100 for k, t in enumerate(ids[1:])]
        rows.append((ids[:-1] + [pad] * (seq - n), targets + [-100] * (seq - n)))
    return rows


def test_each_row_is_one_record_cut_and_padded(tmp_path):
    config = _chat_config(tmp_path)
    rows, _, desc = make_datasets(config)
    assert isinstance(rows, RecordRows)
    corpus, starts, trained = rows.corpus, rows.starts, rows.trained
    lengths = np.diff(starts)
    cut = int((lengths > config.seq + 1).sum())
    assert 0 < cut < len(lengths)  # the test covers both: records cut at seq + 1, and records padded
    assert f"one record per row, {cut:,} of {len(lengths):,} longer than seq + 1 = {config.seq + 1} tokens and cut" in desc
    expected = _expected_rows(corpus, starts, trained, config.seq, rows.pad_id)
    padded = 0
    for _ in range(10):
        x, y = rows.next()
        for row in zip(x.tolist(), y.tolist()):
            assert row in expected
            padded += row[0][-1] == rows.pad_id and row[1][-1] == -100
    assert padded


def test_memferry_on_whole_records_trains_as_plain_pytorch_does(tmp_path, cpu_backend):
    config = _chat_config(tmp_path)
    result = train(config)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    assert result.losses == pytest.approx(plain_adamw_losses(ref, config, max_grad_norm=1.0), abs=1e-5)


def test_eval_holds_out_the_last_records_whole(tmp_path):
    config = _chat_config(tmp_path, eval_fraction=0.25)
    rows, evals, desc = make_datasets(config)
    full, _, _ = make_datasets(_chat_config(tmp_path / "all"))
    everything = _expected_rows(full.corpus, full.starts, full.trained, config.seq, full.pad_id)
    kept = len(rows.starts) - 1
    assert 0 < kept < len(everything) and f"last {len(everything) - kept:,} records held out for eval" in desc
    for x, y in evals:
        for row in zip(x.tolist(), y.tolist()):
            assert row in everything[kept:]
    for _ in range(10):
        x, y = rows.next()
        for row in zip(x.tolist(), y.tolist()):
            assert row in everything[:kept]


def test_rows_resume_where_they_stopped(tmp_path):
    config = _chat_config(tmp_path)
    rows, _, _ = make_datasets(config)
    rows.next()
    state = rows.state_dict()
    want = rows.next()
    again, _, _ = make_datasets(config)
    again.load_state_dict(state)
    got = again.next()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("data, message", [
    ({"kind": "text", "messages_field": None}, "data.packing False: true or false, and false only for data kind jsonl"),
    ({"packing": "no"}, "data.packing 'no': true or false"),
])
def test_bad_packing_is_a_one_line_error(tmp_path, data, message):
    folder, tok = _tokenizer_folder(tmp_path)
    run = _config(tmp_path, _write(tmp_path, _short_conversations(4)), folder, len(tok), packing=False)
    run["data"] = {**run["data"], **data}
    with pytest.raises(TrainConfigError, match=message):
        load_config(run)
