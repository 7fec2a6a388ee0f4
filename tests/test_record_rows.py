"""``data.packing: false``: one whole jsonl record per row (cut at ``seq + 1`` tokens, right-padded
to the batch's longest row rounded up to 8, its padding never a target) instead of windows drawn
across records."""
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
    """One exchange each: a quarter longer than a row of ``seq + 1`` = 41 tokens, the rest shorter."""
    return [[{"role": "user", "content": f"{i}+{i}?"},
             {"role": "assistant", "content": f"{2 * i}." + " Yes." * (8 if i % 4 == 0 else 0)}] for i in range(n)]


def _chat_config(tmp_path, run_keys=None, **data):
    tmp_path.mkdir(exist_ok=True)
    folder, tok = _tokenizer_folder(tmp_path)
    run = _config(tmp_path, _write(tmp_path, _short_conversations()), folder, len(tok), packing=False, **data)
    return load_config({**run, "seq": 40, **(run_keys or {})})


def _expected_rows(corpus, starts, trained, seq):
    """Every record as the row it must become, unpadded: (inputs, targets) lists."""
    rows = []
    for lo, hi in zip(starts[:-1], starts[1:]):
        hi = min(hi, lo + seq + 1)
        ids = [int(t) for t in corpus[lo:hi]]
        rows.append((ids[:-1], [t if trained[lo + 1 + k] else -100 for k, t in enumerate(ids[1:])]))
    return rows


def _rows_of(batch, pad):
    """A batch's rows, unpadded, after checking each is padded with ``pad`` and -100 to the batch's width."""
    out = []
    for x, y in zip(*(t.tolist() for t in batch)):
        n = len(x)
        while n and x[n - 1] == pad and y[n - 1] == -100:
            n -= 1
        assert x[n:] == [pad] * (len(x) - n) and y[n:] == [-100] * (len(y) - n)
        out.append((x[:n], y[:n]))
    return out


def _matches(row, expected):
    """``row`` (unpadded, though a record may end in tokens equal to the padding) is one of ``expected``."""
    return any(x[:len(row[0])] == row[0] and y[:len(row[1])] == row[1] and all(t == -100 for t in y[len(row[1]):])
               for x, y in expected)


def test_each_row_is_one_record_cut_and_padded(tmp_path):
    config = _chat_config(tmp_path)
    rows, _, desc = make_datasets(config)
    assert isinstance(rows, RecordRows)
    corpus, starts, trained = rows.corpus, rows.starts, rows.trained
    lengths = np.diff(starts)
    cut = int((lengths > config.seq + 1).sum())
    assert 0 < cut < len(lengths)  # the test covers both: records cut at seq + 1, and records padded
    assert f"one record per row, {cut:,} of {len(lengths):,} longer than seq + 1 = {config.seq + 1} tokens and cut" in desc
    expected = _expected_rows(corpus, starts, trained, config.seq)
    widths = set()
    for _ in range(10):
        batch = rows.next()
        width = batch[0].shape[1]
        got = _rows_of(batch, rows.pad_id)
        assert all(_matches(row, expected) for row in got)
        longest = max(len(e[0]) for e in expected if any(_matches(row, [e]) for row in got))
        assert width == min(config.seq, -(-longest // 8) * 8)  # the longest row, rounded up to 8
        widths.add(width)
    assert len(widths) > 1 and config.seq in widths  # narrower batches, and full ones
    fixed, _, _ = make_datasets(config, fixed_width=True)
    assert all(fixed.next()[0].shape[1] == config.seq for _ in range(5))


def test_memferry_on_whole_records_trains_as_plain_pytorch_does(tmp_path, cpu_backend):
    """Batches of changing width, with accumulation and clipping: plain AdamW's losses; the run's
    tokens/s counts the tokens its batches held, not ``batch x seq``."""
    config = _chat_config(tmp_path, {"logging": {"csv": str(tmp_path / "log.csv")}})
    result = train(config)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    assert result.losses == pytest.approx(plain_adamw_losses(ref, config, max_grad_norm=1.0), abs=1e-5)
    rows, _, _ = make_datasets(config)
    held = [sum(rows.next()[0].numel() for _ in range(config.accumulation_steps)) for _ in range(config.steps)]
    # the run said so: at most batch x seq a micro-batch, and fewer held
    assert result.info.padded and result.info.tokens_per_step == config.accumulation_steps * config.batch * config.seq
    assert sum(held) < config.steps * result.info.tokens_per_step
    assert result.tokens_per_s * sum(result.step_times_s) == pytest.approx(sum(held), rel=1e-9)
    logged = [line.split(",") for line in (tmp_path / "log.csv").read_text().splitlines()[1:]]
    assert [float(r[4]) * float(r[3]) for r in logged] == pytest.approx(held, rel=1e-6)  # tokens_per_s x step_s


def test_eval_holds_out_the_last_records_whole(tmp_path):
    config = _chat_config(tmp_path, eval_fraction=0.25)
    rows, evals, desc = make_datasets(config)
    full, _, _ = make_datasets(_chat_config(tmp_path / "all"))
    everything = _expected_rows(full.corpus, full.starts, full.trained, config.seq)
    kept = len(rows.starts) - 1
    assert 0 < kept < len(everything) and f"last {len(everything) - kept:,} records held out for eval" in desc
    for batch in evals:
        assert all(_matches(row, everything[kept:]) for row in _rows_of(batch, rows.pad_id))
    for _ in range(10):
        assert all(_matches(row, everything[:kept]) for row in _rows_of(rows.next(), rows.pad_id))


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
    ({"packing": True, "group_by_length": True}, "data.group_by_length True: true or false, and true only with "
                                                 "data.packing: false"),
])
def test_bad_packing_is_a_one_line_error(tmp_path, data, message):
    folder, tok = _tokenizer_folder(tmp_path)
    run = _config(tmp_path, _write(tmp_path, _short_conversations(4)), folder, len(tok), packing=False)
    run["data"] = {**run["data"], **data}
    with pytest.raises(TrainConfigError, match=message):
        load_config(run)


def test_each_epoch_gives_every_record_once(tmp_path):
    config = _chat_config(tmp_path)
    rows, _, desc = make_datasets(config)
    expected = _expected_rows(rows.corpus, rows.starts, rows.trained, config.seq)
    records = len(expected)
    epochs = config.steps * config.accumulation_steps * config.batch / records
    assert f"; {epochs:.3g} epochs in {config.steps:,} steps" in desc
    assert records % config.batch == 0  # so an epoch ends with a batch
    for _ in range(2):
        seen = [next(j for j, e in enumerate(expected) if _matches(row, [e]))
                for _ in range(records // config.batch) for row in _rows_of(rows.next(), rows.pad_id)]
        assert sorted(seen) == list(range(records))


def test_a_resumed_run_sees_the_rows_the_straight_run_saw(tmp_path, cpu_backend):
    """Checkpointed mid-epoch (40 records, 8 rows a step): steps 3-5 after a resume from step 2
    train on the same records, so the losses are the uninterrupted run's."""
    straight = train(_chat_config(tmp_path / "a"))
    ck = tmp_path / "ck"
    first = train(_chat_config(tmp_path / "b", {"steps": 2, "checkpoint": {"every": 2, "dir": str(ck)}}))
    resumed = train(_chat_config(tmp_path / "b", {"resume": str(ck)}))
    assert resumed.steps == [3, 4, 5]
    assert first.losses + resumed.losses == pytest.approx(straight.losses, abs=1e-6)


def test_grouped_by_length_an_epoch_holds_every_record_once_with_less_padding(tmp_path):
    plain, grouped = _chat_config(tmp_path / "a"), _chat_config(tmp_path / "b", group_by_length=True)
    widths, seen = {}, []
    for name, config in (("plain", plain), ("grouped", grouped)):
        rows, _, _ = make_datasets(config)
        expected = _expected_rows(rows.corpus, rows.starts, rows.trained, config.seq)
        batches = [rows.next() for _ in range(len(expected) // config.batch)]  # one epoch
        widths[name] = sum(x.shape[1] for x, _ in batches)
        seen = sorted(next(j for j, e in enumerate(expected) if _matches(row, [e]))
                      for b in batches for row in _rows_of(b, rows.pad_id))
        assert seen == list(range(len(expected)))
        lengths = [len(_rows_of(b, rows.pad_id)[0][0]) for b in batches]
        if name == "grouped":  # one group holds the whole epoch here: longest first
            assert lengths == sorted(lengths, reverse=True)
    assert widths["grouped"] < widths["plain"]
