"""Chat fine-tuning: ``data.messages_field`` renders each jsonl record's conversation with the
tokenizer folder's chat template and trains on the assistant turns alone (every other target -100),
as plain PyTorch with those labels does."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strategies.training import TrainConfigError, load_config, train  # noqa: E402
from strategies.training.data import make_datasets  # noqa: E402
from tests.test_hf_finetune import _jsonl_and_tokenizer, _llama_cfg, _save, plain_adamw_losses  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: Marks the last message: a conversation's rendering does not begin with that of its beginnings.
LAST_MARKED = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def _tokenizer_folder(tmp_path, template=CHATML, markers=("<|im_start|>", "<|im_end|>")):
    """A byte-level BPE trained here, with ``markers`` as special tokens (ChatML's turn tokens) and
    ``template``, saved as a folder."""
    _, tokenizer_json = _jsonl_and_tokenizer(tmp_path, 300)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>",
                                               bos_token="<s>")
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    if template is not None:
        tok.chat_template = template
    folder = tmp_path / "tokenizer"
    tok.save_pretrained(folder)
    return folder, tok


def _trained_runs(tok, stream, trained):
    """The trained tokens of ``stream``, decoded run by run."""
    got, run = [], []
    for token, on in zip(stream + [None], trained + [False]):
        if on:
            run.append(token)
        elif run:
            got.append(tok.decode(run))
            run = []
    return got


def _conversations(n=40):
    """Conversations of one or two exchanges, some with a system message; answers of varied length."""
    out = []
    for i in range(n):
        c = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        c += [{"role": "user", "content": f"What is {i} plus {i}? Say it in words, please."},
              {"role": "assistant", "content": f"The sum is {2 * i}." + " Indeed." * (i % 4)}]
        if i % 2:
            c += [{"role": "user", "content": "And twice that?"},
                  {"role": "assistant", "content": f"Twice that is {4 * i}."}]
        out.append(c)
    return out


def _write(tmp_path, conversations, field="messages"):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return data


def _config(tmp_path, data, tokenizer, vocab, **extra):
    hf_cfg = _llama_cfg()
    hf_cfg.vocab_size = vocab
    path, _ = _save(tmp_path, hf_cfg, "llama")
    return {"model": {"family": "hf", "path": str(path)},
            "steps": 5, "batch": 2, "seq": 24, "dtype": "fp32", "accumulation_steps": 2, "log_every": 10,
            "optimizer": {"lr": 3e-3}, "strategy": {"name": "memferry", "options": {"max_grad_norm": 1.0}},
            "data": {"kind": "jsonl", "path": str(data), "messages_field": "messages", "tokenizer": str(tokenizer),
                     **extra}}


def test_only_the_assistant_turns_are_trained(tmp_path):
    """The stream is each conversation as the template renders it, then the EOS; the tokens trained
    on, decoded run by run, are exactly each assistant turn with its end-of-turn text."""
    folder, tok = _tokenizer_folder(tmp_path)
    conversations = _conversations()
    config = load_config(_config(tmp_path, _write(tmp_path, conversations), folder, len(tok)))
    windows, _, desc = make_datasets(config)
    stream, trained = torch.as_tensor(windows.corpus).tolist(), windows.trained.tolist()
    expected_stream, runs = [], []
    for c in conversations:
        expected_stream += tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
        expected_stream.append(tok.eos_token_id)
        runs += [m["content"] + "<|im_end|>\n" for m in c if m["role"] == "assistant"]
    assert stream == expected_stream
    assert _trained_runs(tok, stream, trained) == runs
    assert f"40 conversations, {len(stream):,} tokens" in desc and f"loss on the {sum(trained):,} assistant tokens" in desc


def test_memferry_trains_assistant_turns_as_plain_pytorch_does(tmp_path, cpu_backend):
    """MemFerry with accumulation and clipping on chat data: plain AdamW's losses on the same batches."""
    folder, tok = _tokenizer_folder(tmp_path)
    config = load_config(_config(tmp_path, _write(tmp_path, _conversations()), folder, len(tok)))
    result = train(config)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    assert result.losses == pytest.approx(plain_adamw_losses(ref, config, max_grad_norm=1.0), abs=1e-5)


@pytest.mark.parametrize("case, message", [
    ("kind text", "data.messages_field 'messages': it names a jsonl record's list of chat messages"),
    ("with a prompt field", "takes the place of data.prompt_field"),
    ("no such field", "line 1 has no field 'conversation' (it has ['id', 'messages']); set data.messages_field"),
    ("not a list", "line 1: the conversation is a str, not a non-empty list"),
    ("no assistant", "line 1: no 'assistant' message, so nothing to train on"),
    ("bad message", "line 1: message 1 is not {'role': str, 'content': str}"),
    ("no template", "has no chat template; put one in the folder"),
    ("tokenizer file", "is a file; data.messages_field needs a tokenizer folder"),
])
def test_bad_chat_data_is_a_one_line_error(tmp_path, case, message):
    folder, tok = _tokenizer_folder(tmp_path, template=None if case == "no template" else CHATML)
    conversations = _conversations(4)
    if case == "not a list":
        conversations[0] = "hello"
    elif case == "no assistant":
        conversations[0] = [{"role": "user", "content": "hi"}]
    elif case == "bad message":
        conversations[0][1] = {"role": "user", "text": "hi"}
    run = _config(tmp_path, _write(tmp_path, conversations), folder, len(tok))
    if case == "kind text":
        run["data"]["kind"] = "text"
    elif case == "with a prompt field":
        run["data"]["prompt_field"] = "id"
    elif case == "no such field":
        run["data"]["messages_field"] = "conversation"
    elif case == "tokenizer file":
        run["data"]["tokenizer"] = str(tmp_path / "tokenizer.json")
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("{", r"\{").replace("}", r"\}")):
        load_config(run)


def test_a_template_that_rewrites_earlier_turns_is_refused_before_training(tmp_path):
    """A template marking the last message renders a beginning unlike the whole: refused with the line."""
    folder, tok = _tokenizer_folder(tmp_path, template=LAST_MARKED)
    config = load_config(_config(tmp_path, _write(tmp_path, _conversations(3)), folder, len(tok)))
    with pytest.raises(TrainConfigError, match=r"line 1: the tokenizer's chat template renders the conversation up "
                                               r"to message 2 differently once later messages follow"):
        make_datasets(config)


def test_the_chat_example_trains_and_exports_a_folder_that_chats(tmp_path, monkeypatch, cpu_backend):
    """examples/finetune/chat-lora.yaml on make_tiny_model.py's stand-in, by the command line: the
    exported folder loads with ``from_pretrained``, keeps the chat template and generates from it."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("peft")
    import strategies.training.cli  # noqa: F401 - registers `xpu train` and `xpu export` (as the entry point does)
    import strategies.training.export_cli  # noqa: F401
    from xpu.cli import main

    root = Path(__file__).resolve().parents[1] / "examples" / "finetune"
    spec = importlib.util.spec_from_file_location("make_tiny_model", root / "make_tiny_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    monkeypatch.chdir(tmp_path)
    maker.main(["runs/tiny-hf", "--layers", "2"])
    assert main(["train", str(root / "chat-lora.yaml"), "--steps", "2", "--no-progress"]) == 0
    assert main(["export", "runs/tiny-hf/chat-lora", "--hf", "out"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained("out")
    model = transformers.AutoModelForCausalLM.from_pretrained("out", dtype=torch.float32)
    assert tok.chat_template == maker.CHAT_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     return_dict=True, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert tok.decode(out[0]).startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") and out.shape[1] == \
        prompt["input_ids"].shape[1] + 3


def test_a_template_that_refuses_a_conversation_is_a_one_line_error(tmp_path):
    """Templates raise on what they do not take (Gemma's on a system message): the line and its reason."""
    refusing = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                "supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    folder, tok = _tokenizer_folder(tmp_path, template=refusing)
    config = load_config(_config(tmp_path, _write(tmp_path, _conversations(3)[1:] + _conversations(1)), folder, len(tok)))
    with pytest.raises(TrainConfigError, match=r"line 3: the tokenizer's chat template refused the conversation's "
                                               r"first 3 messages \(System role not supported\)"):
        make_datasets(config)


def test_a_conversation_opening_with_the_assistant_trains_its_words_not_the_turns_header(tmp_path):
    folder, tok = _tokenizer_folder(tmp_path)
    opening = [[{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Hi."}]] * 3
    config = load_config(_config(tmp_path, _write(tmp_path, opening + _conversations(2)), folder, len(tok)))
    windows, _, _ = make_datasets(config)
    header = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    first = tok("<|im_start|>assistant\nHello there.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert windows.trained[:len(first)].tolist() == [False] * header + [True] * (len(first) - header)


#: Templates written after those of common model families: each, the text its assistant turns end with.
FAMILIES = {
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}", "<|eot_id|>",
               ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
                "<|endoftext|>", ["[INST]", "[/INST]"]),
    "gemma": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
              "{% else %}{% set role = m['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
              "<end_of_turn>\n", ["<start_of_turn>", "<end_of_turn>"]),
    "qwen2.5": ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
                + CHATML, "<|im_end|>\n", ["<|im_start|>", "<|im_end|>"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_of_common_families_train_their_assistant_turns(tmp_path, family):
    """Decoded run by run, the trained tokens are each assistant turn and its end-of-turn text; a
    template that ends a turn with the EOS (Mistral's) gets no second one."""
    template, end, markers = FAMILIES[family]
    folder, tok = _tokenizer_folder(tmp_path, template=template, markers=markers)
    conversations = _conversations(6)
    config = load_config(_config(tmp_path, _write(tmp_path, conversations), folder, len(tok)))
    windows, _, _ = make_datasets(config)
    stream, trained = torch.as_tensor(windows.corpus).tolist(), windows.trained.tolist()
    assert _trained_runs(tok, stream, trained) == [m["content"] + end for c in conversations for m in c if m["role"] == "assistant"]
    text = tok.decode(stream)
    assert text.count("<|endoftext|>") >= len(conversations) and "<|endoftext|><|endoftext|>" not in text


def test_a_chat_tokenizer_folder_loads_once_until_its_files_change(tmp_path):
    import os

    from strategies.training.chat import load_chat_tokenizer

    folder, _ = _tokenizer_folder(tmp_path)
    first = load_chat_tokenizer(folder, "tokenizer")
    assert load_chat_tokenizer(folder, "tokenizer") is first  # the checks' load serves the data too
    config = folder / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a rewritten file: loaded afresh
    assert load_chat_tokenizer(folder, "tokenizer") is not first
