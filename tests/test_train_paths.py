"""Relative input paths of a train config (``model.path``, ``data.path``, ``data.tokenizer``): next to the
config file first, then the working directory, whatever the working directory is."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from strategies.training import load_config, make_datasets, read_checkpoint, train  # noqa: E402

WORDS = "the cat sat on the mat and the dog ran to the cat".split()


def _tiny_llama(folder):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, safe_serialization=True)


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(path))


def test_model_path_and_tokenizer_are_found_next_to_the_config_from_any_working_directory(tmp_path, monkeypatch,
                                                                                          cpu_backend):
    home = tmp_path / "project"
    home.mkdir()
    _tiny_llama(home / "tiny-llama")
    _tokenizer_json(home / "tok.json")
    (home / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(WORDS * 4)}) + "\n" for _ in range(8)))
    run = {"model": {"family": "hf", "path": "tiny-llama"}, "strategy": "torch", "steps": 1, "batch": 2, "seq": 8,
           "dtype": "fp32", "data": {"kind": "jsonl", "path": "docs.jsonl", "tokenizer": "tok.json"},
           "checkpoint": {"dir": str(tmp_path / "ck")}}
    (home / "run.yaml").write_text(yaml.safe_dump(run))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # nothing of the run is here

    config = load_config(home / "run.yaml")
    assert config.model["path"] == str(home / "tiny-llama")  # recorded resolved, as the checkpoint will keep it
    assert (config.vocab(), config.n_blocks()) == (128, 2)
    assert config.data_path(config.data.tokenizer) == home / "tok.json"
    make_datasets(config)  # the tokenizer loads from there
    result = train(config, backend=cpu_backend)
    saved = read_checkpoint(result.checkpoints[-1])["config"]
    assert saved["model"]["path"] == str(home / "tiny-llama")  # `xpu export` of this checkpoint finds the folder
    assert load_config(home / "run.yaml", {"steps": 2, "resume": str(tmp_path / "ck")}).model == config.model


def test_a_model_path_not_next_to_the_config_is_still_read_from_the_working_directory(tmp_path, monkeypatch):
    _tiny_llama(tmp_path / "tiny-llama")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text(yaml.safe_dump(
        {"model": {"family": "hf", "path": "tiny-llama"}, "seq": 8, "data": {"kind": "synthetic"}}))
    monkeypatch.chdir(tmp_path)
    config = load_config(tmp_path / "cfg" / "run.yaml")
    assert config.model["path"] == "tiny-llama" and config.vocab() == 128
    monkeypatch.chdir(tmp_path / "cfg")  # found in neither place: the one-line error names the path
    with pytest.raises(Exception, match="path 'tiny-llama' must be a local folder with config.json"):
        load_config(tmp_path / "cfg" / "run.yaml")
