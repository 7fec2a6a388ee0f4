"""Completion-only fine-tuning: ``data.prompt_field`` puts each jsonl record's prompt before its text and
takes no loss on the prompt's tokens (their targets are -100), as plain PyTorch with those labels does."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.models.base import token_mean_loss  # noqa: E402
from strategies.training import TrainConfigError, load_config, train  # noqa: E402
from strategies.training.corpora import load_tokenizer  # noqa: E402
from strategies.training.data import make_datasets  # noqa: E402
from tests.test_hf_finetune import _jsonl_and_tokenizer, _llama_cfg, _save, plain_adamw_losses  # noqa: E402


def _records(tmp_path):
    """A prompt/completion jsonl (the prompts long, so some windows hold prompt tokens only) and its tokenizer."""
    docs, tokenizer = _jsonl_and_tokenizer(tmp_path, 300)
    texts = [json.loads(line)["text"] for line in docs.read_text().splitlines()]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: {t} {t}", "answer": t[: 20 + i]}) + "\n"
                            for i, t in enumerate(texts)))
    return data, tokenizer


def _config(tmp_path, data, tokenizer):
    hf_cfg = _llama_cfg()
    hf_cfg.vocab_size = 300  # the byte-level alphabet (256) and some merges
    path, _ = _save(tmp_path, hf_cfg, "llama")
    return {"model": {"family": "hf", "path": str(path)},
            "steps": 6, "batch": 2, "seq": 16, "dtype": "fp32", "accumulation_steps": 2, "log_every": 10,
            "optimizer": {"lr": 3e-3}, "strategy": {"name": "memferry", "options": {"max_grad_norm": 1.0}},
            "data": {"kind": "jsonl", "path": str(data), "field": "answer", "prompt_field": "prompt",
                     "tokenizer": str(tokenizer)}}


def test_prompt_tokens_are_not_targets(tmp_path):
    """Every target is the next token where that token belongs to a record's answer or its EOS, else -100."""
    data, tokenizer = _records(tmp_path)
    config = load_config(_config(tmp_path, data, tokenizer))
    windows, _, desc = make_datasets(config)
    encode, eos, _ = load_tokenizer(tokenizer)
    stream, trained = [], []
    for line in data.read_text().splitlines():
        record = json.loads(line)
        prompt, answer = encode([record["prompt"]])[0], encode([record["answer"]])[0]
        stream += prompt + answer + [eos]
        trained += [False] * len(prompt) + [True] * (len(answer) + 1)
    assert torch.equal(torch.as_tensor(windows.corpus), torch.tensor(stream))
    assert f"loss on {sum(trained):,} 'answer' tokens, not the 'prompt' ones" in desc
    seen = 0
    for _ in range(20):
        x, y = windows.next()
        for row_x, row_y in zip(x, y):
            start = next(s for s in range(len(stream) - 16) if stream[s:s + 16] == row_x.tolist()
                         and all(t == -100 or t == stream[s + 1 + k] for k, t in enumerate(row_y.tolist())))
            want = [stream[start + 1 + k] if trained[start + 1 + k] else -100 for k in range(16)]
            assert row_y.tolist() == want
            seen += (row_y == -100).all().item()
    assert seen  # the long prompts gave windows with no target at all


def test_a_batch_of_prompt_tokens_only_has_loss_zero_and_zero_gradients():
    logits = torch.randn(2, 4, 9, requires_grad=True)
    loss = token_mean_loss(logits, torch.full((2, 4), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    t = torch.randint(0, 9, (2, 4))
    t[0, :2] = -100
    torch.testing.assert_close(token_mean_loss(logits, t),
                               torch.nn.functional.cross_entropy(logits.reshape(-1, 9), t.reshape(-1)), rtol=0, atol=0)


def test_memferry_trains_completions_only_as_plain_pytorch_does(tmp_path, cpu_backend):
    """MemFerry with accumulation and clipping on masked targets: plain AdamW's losses on the same batches."""
    data, tokenizer = _records(tmp_path)
    config = load_config(_config(tmp_path, data, tokenizer))
    result = train(config)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    losses = plain_adamw_losses(ref, config, max_grad_norm=1.0)
    assert result.losses == pytest.approx(losses, abs=1e-5)


@pytest.mark.parametrize("data, message", [
    ({"kind": "text", "prompt_field": "prompt"}, "data.prompt_field 'prompt': it names a jsonl"),
    ({"prompt_field": "answer"}, "other than data.field 'answer'"),
    ({"prompt_field": "question"}, "line 1 has no field 'question' (it has ['answer', 'prompt']); set data.prompt_field"),
])
def test_bad_prompt_fields_are_one_line_errors(tmp_path, data, message):
    pairs, tokenizer = _records(tmp_path)
    run = _config(tmp_path, pairs, tokenizer)
    run["data"] = {**run["data"], **data}
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(run)
